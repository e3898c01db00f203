"""What every op shares: where a tensor's kernels run, and input checks with clear errors."""

from __future__ import annotations

import os

import torch


def runs_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels handle ``tensor``.

    CUDA tensors always run the kernels. CPU tensors run them under the Triton interpreter when
    ``TRITON_INTERPRET=1`` was set before fastlm was imported (slow; used to test kernel logic
    on machines without a GPU), and otherwise take the plain-PyTorch reference path.
    """
    if tensor.is_cuda:
        return True
    return tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the tensors when they are not all on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"expected all tensors on one device, got {listed}")


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise ``TypeError`` when ``tensor.dtype`` is not one of ``allowed``."""
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(tensor.dtype).removeprefix('torch.')}")
