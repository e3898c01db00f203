"""What every op shares: where a tensor's kernels run, and input checks with clear errors."""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the floating-point dtypes the ops' kernels take


def runs_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels handle ``tensor``.

    CUDA tensors always run the kernels. CPU tensors run them under the Triton interpreter when
    ``TRITON_INTERPRET=1`` was set before fastlm was imported (slow; used to test kernel logic
    on machines without a GPU), and otherwise take the plain-PyTorch reference path, as they do
    while torch.compile traces (the interpreter cannot run on the fake tensors of a trace).
    """
    if tensor.is_cuda:
        return True
    interpreted = tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted and not is_traced(tensor)


def is_traced(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` stands for data rather than holding it: torch.compile is tracing, or it
    is a fake / functional tensor (opcheck, AOT autograd)."""
    return torch.compiler.is_compiling() or isinstance(tensor, (FakeTensor, FunctionalTensor))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (R, D) with unit column stride: a view when the layout allows, else a copy."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (not -1: D may be 0)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# Argument checks run on every call: the common types are tested first, by an exact type test
# (isinstance on torch.Tensor takes a slow path for Parameters).
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_INF = math.inf


def check_tensor(name: str, value) -> None:
    """Raise ``TypeError`` naming the argument when ``value`` is not a tensor."""
    if type(value) not in _TENSOR_TYPES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_optional_tensor(name: str, value) -> None:
    """Raise ``TypeError`` naming the argument when ``value`` is neither a tensor nor None."""
    if value is not None and type(value) not in _TENSOR_TYPES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")


def check_flag(name: str, value) -> bool:
    """``value`` if it is a bool, else ``TypeError``: a truthy string or tensor would pass silently."""
    if value is True or value is False:
        return value
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_integer(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int: ints and numpy integers pass; a float (2.7 would truncate to 2), a bool or
    a tensor (reading it would sync the device) is a ``TypeError``; below ``minimum`` a ``ValueError``."""
    if type(value) is not int:
        if isinstance(value, (bool, torch.Tensor)) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_number(
    name: str, value, minimum: float | None = None, maximum: float | None = None, positive: bool = False
) -> float:
    """``value`` as a float: a finite real number (int, float, numpy scalar) within [minimum, maximum]
    (``positive``: > 0). A tensor, a bool or a string is a ``TypeError``; NaN, inf or a value out of
    range a ``ValueError``."""
    if type(value) is not float:
        if type(value) is not int and (isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real)):
            raise TypeError(f"{name} must be a number (int or float), got {type(value).__name__}")
        value = float(value)
    # comparisons rather than math.isfinite: a traced float (torch.compile, dynamic=True) takes them
    above = value > 0.0 if positive else minimum is None or value >= minimum
    if -_INF < value < _INF and above and (maximum is None or value <= maximum):
        return value
    raise ValueError(f"{name} must be a finite number{_range(minimum, maximum, positive)}, got {value}")


def _range(minimum: float | None, maximum: float | None, positive: bool) -> str:
    if positive:
        return " > 0"
    if maximum is not None:
        return f" in [{minimum}, {maximum}]"
    return f" >= {minimum}" if minimum is not None else ""


def may_overlap(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides may map two elements to one address (an expanded view: a stride-0
    dim of size > 1; an as_strided view), so that writing into it would write one element over
    another. Sufficient test: sorted by stride, each dim's stride must pass the span of the smaller
    ones (a few exotic non-overlapping layouts count as overlapping too)."""
    if tensor.is_contiguous():
        return False
    span = 0  # the largest offset the dims with smaller strides reach
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


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


@dataclass(frozen=True)
class RowTiles:
    """How a row-wise kernel covers (M, D): (block_m, block_d) tiles and warps per program; rows
    wider than the widest block held in registers loop over block_d chunks (single_pass False)."""

    block_m: int
    block_d: int
    single_pass: bool
    num_warps: int


@functools.cache
def multiprocessors(device_index: int) -> int:
    """SMs of a CUDA device, for persistent grids (a few programs per SM)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _cuda_arch(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def device_arch(device: torch.device) -> int:
    """Compute capability as one number (80 A100, 90 H100 / H200), the key of the ops' launch-config
    tables; 0 for a CPU (the interpreter), which takes each table's default. Cached per device."""
    return (
        _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 0
    )


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for inputs of ``dtype``: fp32 follows torch's matmul setting
    (TF32 only when the user allowed it), 16-bit inputs are exact in any mode."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), for grids. In Triton 3.6 `triton.cdiv` is a constexpr function, and a call from
    Python pays for unwrapping its arguments: several calls per launch on every eager step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as `triton.next_power_of_2`, and as cheap as `cdiv`);
    bit operations only, so symbolic sizes of a trace pass through."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def row_tiles(d: int, tile: int, per_warp: int, block_max: int, looped_warps: int = 16) -> RowTiles:
    """Stack rows of width ``d`` into tiles of about ``tile`` elements, one warp per ``per_warp``
    elements (at most 16); rows wider than ``block_max`` get one row per program and
    ``looped_warps`` warps."""
    block_d = next_power_of_2(d)
    if block_d > block_max:
        return RowTiles(1, block_max, False, looped_warps)
    block_m = max(1, tile // block_d)
    return RowTiles(block_m, block_d, True, max(1, min(16, block_m * block_d // per_warp)))
