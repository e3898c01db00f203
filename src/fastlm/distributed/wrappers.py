"""The data-parallel wrappers by name: how each parallel mode wraps a model and averages gradients.

    none        the model itself, no averaging (one process; or the compute-only step of a benchmark)
    naive       `allreduce_gradients` after backward, one all-reduce per parameter
    flat        the same, all gradients flattened into one buffer and one all-reduce
    ddp         fastlm `DDP`: an async all-reduce per parameter, started from its gradient hook
    bucketed    fastlm `BucketedDDP`, buckets of `bucket_mb` MB (required)
    torch-ddp   PyTorch `DistributedDataParallel`, buckets of `bucket_mb` MB (PyTorch's 25 without)
    fsdp        PyTorch FSDP2 `fully_shard` on each of `model.blocks` and on the root: parameters,
                gradients and optimizer state sharded (a `TransformerLM`)

A mode is given as a `ParallelSpec`; `wrap(model, spec, device)` returns the module to call and
the synchronization to run after backward (nothing for the wrappers that synchronize inside
backward). Importing this module needs no torch, so the command line parses a spec without it;
`wrap` imports the wrappers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODES = ("none", "naive", "flat", "ddp", "bucketed", "torch-ddp", "fsdp")
BUCKETED_MODES = ("bucketed", "torch-ddp")  # the modes that take a bucket size


@dataclass(frozen=True)
class ParallelSpec:
    """A parallel mode (one of MODES) and, for the bucketed ones, the bucket size in MB."""

    mode: str
    bucket_mb: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown parallel mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.mode == "bucketed" and self.bucket_mb is None:
            raise ValueError("parallel mode bucketed needs bucket_mb, the bucket size in MB")
        if self.bucket_mb is not None and self.mode not in BUCKETED_MODES:
            raise ValueError(f"parallel mode {self.mode} takes no bucket_mb; only {', '.join(BUCKETED_MODES)} do")
        if self.bucket_mb is not None and not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"bucket_mb must be a positive finite number of MB, got {self.bucket_mb}")


@dataclass(frozen=True)
class Wrapped:
    module: Any  # torch.nn.Module: what the training step calls
    synchronize: Callable[[], None]  # after backward: finishes averaging the gradients over the ranks


def _none(model, spec: ParallelSpec, device) -> Wrapped:
    return Wrapped(model, lambda: None)


def _after_backward(model, spec: ParallelSpec, device) -> Wrapped:
    from fastlm.distributed.ddp import allreduce_gradients

    return Wrapped(model, lambda: allreduce_gradients(model, flat=spec.mode == "flat"))


def _ddp(model, spec: ParallelSpec, device) -> Wrapped:
    from fastlm.distributed.ddp import DDP

    wrapped = DDP(model)
    return Wrapped(wrapped, wrapped.finish_gradient_synchronization)


def _bucketed(model, spec: ParallelSpec, device) -> Wrapped:
    from fastlm.distributed.ddp import BucketedDDP

    wrapped = BucketedDDP(model, spec.bucket_mb)
    return Wrapped(wrapped, wrapped.finish_gradient_synchronization)


def _torch_ddp(model, spec: ParallelSpec, device) -> Wrapped:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    buckets = {} if spec.bucket_mb is None else {"bucket_cap_mb": spec.bucket_mb}
    return Wrapped(DistributedDataParallel(model, device_ids=device_ids, **buckets), lambda: None)


def _fsdp(model, spec: ParallelSpec, device) -> Wrapped:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return Wrapped(fully_shard(model), lambda: None)


CONSTRUCTORS: dict[str, Callable[[Any, ParallelSpec, Any], Wrapped]] = {
    "none": _none,
    "naive": _after_backward,
    "flat": _after_backward,
    "ddp": _ddp,
    "bucketed": _bucketed,
    "torch-ddp": _torch_ddp,
    "fsdp": _fsdp,
}


def wrap(model: torch.nn.Module, spec: ParallelSpec, device: torch.device) -> Wrapped:
    """``model`` (on ``device``, inside an initialized process group unless mode none) wrapped for
    ``spec``'s mode."""
    return CONSTRUCTORS[spec.mode](model, spec, device)
