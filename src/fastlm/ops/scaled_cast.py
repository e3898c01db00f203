"""A flat tensor cast to a wider dtype and optionally scaled, in one pass: y = float(x) * scale.

    x (N,) contiguous (bf16, fp16 or fp32), scale a 0-dim or one-element tensor or None -> y (N,)

Where data-parallel gradients come back from a bf16 all-reduce into fp32 weights' gradients, this
is the copy back with gradient clipping's multiply folded in: read 2 N, write 4 N bytes, where a
cast and then an in-place multiply read and write the fp32 result once more. Each element is
widened exactly and the product rounded once, as the cast then the multiply would round it, so
the result is bitwise the same. PyTorch's own `torch.mul` of a bf16 tensor by a one-element fp32
tensor gives the same values but runs its generic (unvectorized) broadcasting kernel, at about
half the memory bandwidth of this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastlm.ops.common import DTYPES, cdiv, check_tensor, runs_triton
from fastlm.ops.launch import launcher

BLOCK = 8192  # elements per program: 32 per thread at 8 warps, in 16-byte loads and stores
NUM_WARPS = 8


@triton.jit
def _scaled_cast_kernel(
    X,  # (N,) contiguous, the narrow dtype
    Y,  # (N,) contiguous, the wide dtype
    SCALE,  # (1,) in Y's dtype; unread without HAS_SCALE
    N,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: N may pass 2^31
    mask = offsets < N
    y = tl.load(X + offsets, mask=mask).to(Y.dtype.element_ty)
    if HAS_SCALE:
        y = y * tl.load(SCALE)
    tl.store(Y + offsets, y, mask=mask)


_launch = launcher(_scaled_cast_kernel)


def scaled_cast(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (1-D, contiguous) as a new tensor of ``dtype`` (at least as wide as ``x``'s), times
    ``scale`` (a one-element tensor on x's device) when given."""
    check_tensor("x", x)
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be 1-D and contiguous, got shape {tuple(x.shape)}, strides {x.stride()}")
    if x.dtype not in DTYPES or dtype not in DTYPES or torch.promote_types(x.dtype, dtype) != dtype:
        raise ValueError(f"dtype must be a floating-point dtype at least as wide as x's {x.dtype}, got {dtype}")
    if scale is not None and (scale.numel() != 1 or scale.device != x.device):
        raise ValueError(f"scale must be one element on {x.device}, got {tuple(scale.shape)} on {scale.device}")
    if scale is not None:
        scale = scale.reshape(1).to(dtype)
    if not runs_triton(x):
        return scaled_cast_ref(x, dtype, scale)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    if n == 0:
        return y
    _launch(False)[(cdiv(n, BLOCK),)](
        x, y, y if scale is None else scale, n, HAS_SCALE=scale is not None, BLOCK=BLOCK, num_warps=NUM_WARPS
    )
    return y


def scaled_cast_ref(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: a one-element ``scale`` (unlike a 0-dim one) takes part in type promotion, so
    x is read in ``dtype`` and each product rounded once."""
    return x.to(dtype, copy=True) if scale is None else torch.mul(x, scale.reshape(1).to(dtype))
