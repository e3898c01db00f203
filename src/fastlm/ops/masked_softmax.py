"""Masked softmax over the last dimension: fused Triton forward and backward.

    y = softmax(scale * x + mask)        over the last dim of x (..., Sq, Sk)
    dx = scale * y * (dy - sum(dy * y))  (row sum over Sk)

`mask` is additive (0 to keep, -inf to drop, or any bias) and broadcasts to x: (B, 1, 1, Sk) key
padding, (1, 1, Sq, Sk) or (Sq, Sk) attention masks are read through stride-0 dimensions, never
materialized (for x of more than 4 dimensions, folding the leading ones may copy the mask).
`causal=True` adds the implicit causal mask instead of reading one: query i sees key j iff
j <= i + (Sk - Sq), aligned bottom-right like `fastlm.flash_attention` (the usual lower triangle
when Sq == Sk); masked keys are not even loaded. A row with no visible key (every score -inf)
gives y = 0 and dx = 0, not NaN.

NaN and inf follow torch.softmax over the visible scores: a NaN score, or a +inf one (inf - inf
is NaN when the max is subtracted), makes the whole row NaN; -inf scores give 0. Keys hidden by
`causal=True` are never read, so a NaN there changes nothing (as with torch's masked_fill of -inf).

x is viewed as (B, H, Sq, Sk) (leading dimensions beyond two fold into B) and read through its
strides. Rows up to `SoftmaxConfig.block_max` (16384) wide are held in registers, several short
rows per (BLOCK_M, BLOCK_K) tile; longer rows (65536 and beyond are tested) take two passes: an
online max / sum, then the output (the backward: the row sum, then dx).

Bytes (minimum, x of element size s, R = B*H*Sq rows): forward R*Sk*s read + R*Sk*s written (+ the
mask's own size); backward 2*R*Sk*s read (y, dy) + R*Sk*s written (dx).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastlm.ops.common import (
    DTYPES,
    RowTiles,
    as_rows,
    cdiv,
    check_dtype,
    check_flag,
    check_number,
    check_optional_tensor,
    check_same_device,
    check_tensor,
    device_arch,
    row_tiles,
    runs_triton,
)
from fastlm.ops.constants import LOG2E
from fastlm.ops.launch import launcher

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scores(
    X,
    MASK,
    x_offsets,
    mask_offsets,
    cols,
    q,
    row_mask,
    Sq,
    Sk,
    scale,
    stride_xk,
    stride_mk,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """scale * x + mask for a (rows, cols) tile, -inf where masked or out of bounds."""
    visible = row_mask[:, None] & (cols < Sk)[None, :]
    if CAUSAL:
        visible = visible & (cols[None, :] <= q[:, None] + (Sk - Sq))
    x = tl.load(X + x_offsets[:, None] + cols[None, :] * stride_xk, mask=visible, other=0.0)
    s = x.to(tl.float32) * scale
    if HAS_MASK:
        bias = tl.load(MASK + mask_offsets[:, None] + cols[None, :] * stride_mk, mask=visible, other=0.0)
        s += bias.to(tl.float32)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _softmax_forward_kernel(
    X,  # (B, H, Sq, Sk) through its strides
    MASK,  # broadcast to (B, H, Sq, Sk) through its strides (0 on broadcast dims), or a dummy
    Y,  # (R, Sk) contiguous output, R = B * H * Sq
    H, Sq, Sk, R,
    stride_xb, stride_xh, stride_xq, stride_xk,
    stride_mb, stride_mh, stride_mq, stride_mk,
    scale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (1 on the looped path)
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # torch.compile passes Python floats as fp64: keep the math in fp32
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < R
    q = rows % Sq
    b, h = rows // (H * Sq), (rows // Sq) % H
    x_offsets = b * stride_xb + h * stride_xh + q * stride_xq
    mask_offsets = b * stride_mb + h * stride_mh + q * stride_mq
    y_rows = Y + rows[:, None] * Sk
    cols = tl.arange(0, BLOCK_K)
    if SINGLE_PASS:
        s = _scores(
            X, MASK, x_offsets, mask_offsets, cols, q, row_mask, Sq, Sk, scale, stride_xk, stride_mk, HAS_MASK, CAUSAL
        )
        row_max = tl.max(s, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a fully masked row: e = 0 below
        e = tl.exp2((s - row_max[:, None]) * LOG2E)
        total = tl.sum(e, axis=1)
        inverse = 1.0 / tl.where(total == 0.0, 1.0, total)  # a fully masked row: e = 0, y = 0; NaN stays NaN
        y = e * inverse[:, None]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=row_mask[:, None] & (cols < Sk)[None, :])
    else:
        # pass 1: per-lane online max and sum, then combined over the lanes
        lane_max = tl.full((BLOCK_M, BLOCK_K), float("-inf"), tl.float32)
        lane_sum = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for start in range(0, Sk, BLOCK_K):
            s = _scores(
                X,
                MASK,
                x_offsets,
                mask_offsets,
                start + cols,
                q,
                row_mask,
                Sq,
                Sk,
                scale,
                stride_xk,
                stride_mk,
                HAS_MASK,
                CAUSAL,
            )
            new_max = tl.maximum(lane_max, s)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp2((lane_max - safe_max) * LOG2E) + tl.exp2((s - safe_max) * LOG2E)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(lane_sum * tl.exp2((lane_max - row_max[:, None]) * LOG2E), axis=1)
        inverse = 1.0 / tl.where(total == 0.0, 1.0, total)  # a fully masked row: e = 0, y = 0; NaN stays NaN
        for start in range(0, Sk, BLOCK_K):  # pass 2: the output
            s = _scores(
                X,
                MASK,
                x_offsets,
                mask_offsets,
                start + cols,
                q,
                row_mask,
                Sq,
                Sk,
                scale,
                stride_xk,
                stride_mk,
                HAS_MASK,
                CAUSAL,
            )
            y = tl.exp2((s - row_max[:, None]) * LOG2E) * inverse[:, None]
            in_bounds = row_mask[:, None] & (start + cols < Sk)[None, :]
            tl.store(y_rows + start + cols[None, :], y.to(Y.dtype.element_ty), mask=in_bounds)


@triton.jit
def _softmax_backward_kernel(
    Y,  # (R, Sk) contiguous forward output
    DY,  # (R, Sk), row stride stride_dy
    DX,  # (R, Sk) contiguous input gradient
    R, Sk, stride_dy, scale,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # fp64 under torch.compile
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < R
    cols = tl.arange(0, BLOCK_K)
    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < Sk)[None, :]
        y = tl.load(Y + rows[:, None] * Sk + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - tl.sum(dy * y, axis=1)[:, None])
        tl.store(DX + rows[:, None] * Sk + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    else:
        dot = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for start in range(0, Sk, BLOCK_K):  # pass 1: sum(dy * y)
            mask = row_mask[:, None] & (start + cols < Sk)[None, :]
            y = tl.load(Y + rows[:, None] * Sk + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + start + cols[None, :], mask=mask, other=0.0)
            dot += dy.to(tl.float32) * y
        row_dot = tl.sum(dot, axis=1)[:, None]
        for start in range(0, Sk, BLOCK_K):  # pass 2: dx
            mask = row_mask[:, None] & (start + cols < Sk)[None, :]
            y = tl.load(Y + rows[:, None] * Sk + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + start + cols[None, :], mask=mask, other=0.0)
            dx = scale * y * (dy.to(tl.float32) - row_dot)
            tl.store(DX + rows[:, None] * Sk + start + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftmaxConfig:
    """How both kernels cover rows of Sk keys (`fastlm.ops.common.row_tiles`): short rows stack into
    (BLOCK_M, BLOCK_K) tiles held in registers, wider rows loop over chunks, one row per program."""

    block_max: int  # widest row held in registers (a power of two); wider rows loop over chunks this wide
    tile: int  # elements per (BLOCK_M, BLOCK_K) tile of stacked short rows
    per_warp: int  # elements per warp in such a tile (at most 16 warps)
    looped_warps: int  # warps of a looped (long-row) program

    def tiles(self, sk: int) -> RowTiles:
        """The tiling of rows Sk wide (bit operations only: a traced, symbolic Sk passes through)."""
        return row_tiles(sk, self.tile, self.per_warp, self.block_max, self.looped_warps)


# By device_arch. H100 / H200 (90): tile and per_warp are the norm kernels' tuning (they move the
# same bytes per element); looped_warps from benchmarks/tune_softmax.py on 65536-wide rows
# (benchmarks/results/softmax_tuning_h100.jsonl): with 32 the registers allow twice the warps per
# SM of 16, which hides more load latency (ncu: the 16-warp forward read only the minimum bytes
# from DRAM but ran at 24% occupancy).
_CONFIGS = {90: SoftmaxConfig(block_max=16384, tile=8192, per_warp=512, looped_warps=32)}
DEFAULT_CONFIG = _CONFIGS[90]  # GPUs nobody measured, and the interpreter (0)


@functools.cache
def masked_softmax_config(arch: int, dtype: torch.dtype) -> SoftmaxConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`) and ``dtype``; no
    entry depends on the dtype yet. Cached: one dict lookup per call. Sk is applied by
    `SoftmaxConfig.tiles`, outside the cache: inside the triton_op a traced Sk may be a SymInt,
    which cannot be hashed."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Function and the triton_ops
# ----------------------------------------------------------------------------------------------

_launch_softmax_forward = launcher(_softmax_forward_kernel)
_launch_softmax_backward = launcher(_softmax_backward_kernel)


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., Sq, Sk) -> (B, H, Sq, Sk): missing leading dims are 1, extra ones fold into B."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])


def _forward(x, mask, scale: float, causal: bool, config: SoftmaxConfig | None = None, traced: bool = False):
    """y (contiguous, x's shape and dtype); ``config`` None picks it; ``traced`` inside the triton_op."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    if not runs_triton(x):
        return y.copy_(_reference(x, mask, scale, causal))
    x4 = as_4d(x)
    b, h, sq, sk = x4.shape
    mask4 = as_4d(mask.expand(x.shape)) if mask is not None else x4  # stride 0 on broadcast dims, no copy
    tiles = (config or masked_softmax_config(device_arch(x.device), x.dtype)).tiles(sk)
    rows = b * h * sq
    _launch_softmax_forward(traced)[(cdiv(rows, tiles.block_m),)](
        x4,
        mask4,
        y,
        h,
        sq,
        sk,
        rows,
        *x4.stride(),
        *mask4.stride(),
        scale,
        HAS_MASK=mask is not None,
        CAUSAL=causal,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_d,
        SINGLE_PASS=tiles.single_pass,
        num_warps=tiles.num_warps,
    )
    return y


def _backward(dy, y, scale: float, config: SoftmaxConfig | None = None, traced: bool = False) -> torch.Tensor:
    """dx (y's shape and dtype) from the forward output y (contiguous); ``config`` None picks it;
    ``traced`` inside the triton_op."""
    dx = torch.empty_like(y)
    if y.numel() == 0:
        return dx
    if not runs_triton(y):
        y32, dy32 = y.float(), dy.float()
        return dx.copy_(scale * y32 * (dy32 - (dy32 * y32).sum(dim=-1, keepdim=True)))
    sk = y.shape[-1]
    dy_rows = as_rows(dy)  # a view unless dy's last dim is strided
    rows = dy_rows.shape[0]
    tiles = (config or masked_softmax_config(device_arch(y.device), y.dtype)).tiles(sk)
    _launch_softmax_backward(traced)[(cdiv(rows, tiles.block_m),)](
        y,
        dy_rows,
        dx,
        rows,
        sk,
        dy_rows.stride(0),
        scale,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_d,
        SINGLE_PASS=tiles.single_pass,
        num_warps=tiles.num_warps,
    )
    return dx


def _reference(x, mask, scale, causal):
    """PyTorch in fp32 (fp64 for fp64 input): scale, mask, softmax; rows with no visible key give 0,
    rows with a NaN or +inf score NaN (as torch.softmax). Differentiable, with finite gradients on
    fully masked rows too."""
    s = x.to(torch.promote_types(x.dtype, torch.float32)) * scale
    if mask is not None:
        s = s + mask.to(s.dtype)
    if causal:
        sq, sk = x.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril(diagonal=sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    if s.shape[-1] == 0:  # rows of no key (amax has nothing to reduce)
        return s.to(x.dtype)
    row_max = s.amax(dim=-1, keepdim=True).detach()  # the shift does not change y: no gradient
    e = torch.exp(s - torch.where(row_max == float("-inf"), 0.0, row_max))  # a fully masked row: e = 0
    total = e.sum(dim=-1, keepdim=True)
    return (e / torch.where(total == 0, 1.0, total)).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::masked_softmax_forward", mutates_args=())
def _forward_op(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool) -> torch.Tensor:
    return _forward(x, mask, scale, causal, traced=True)


@torch.library.triton_op("fastlm::masked_softmax_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return _backward(dy, y, scale, traced=True)


def _save_context(ctx, mask, scale, y):
    ctx.save_for_backward(y)
    ctx.scale, ctx.mask_shape = scale, None if mask is None else mask.shape


def _gradients(ctx, dy, backward):
    """(dx, dmask) with ``backward(dy, y, scale)`` (the launcher or the backward op): the additive
    mask's gradient is dx / scale summed over its broadcast dims."""
    (y,) = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        return backward(dy, y, ctx.scale), None
    unscaled = backward(dy, y, 1.0)
    return unscaled * ctx.scale, unscaled.sum_to_size(ctx.mask_shape)


def _op_setup_context(ctx, inputs, output):
    _, mask, scale, _ = inputs
    _save_context(ctx, mask, scale, output)


def _op_backward(ctx, dy):
    return *_gradients(ctx, dy, _backward_op), None, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


class MaskedSoftmaxFunction(torch.autograd.Function):
    """Eager path: ``MaskedSoftmaxFunction.apply(x, mask, scale, causal, config)``, the launchers
    behind a plain autograd.Function (no torch.library dispatch cost); the inputs were checked by the
    public function, and the backward checks nothing again."""

    @staticmethod
    def forward(ctx, x, mask, scale, causal, config):
        y = _forward(x, mask, scale, causal, config)
        _save_context(ctx, mask, scale, y)
        ctx.config = config
        return y

    @staticmethod
    def backward(ctx, dy):
        return *_gradients(ctx, dy, functools.partial(_backward, config=ctx.config)), None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(x: torch.Tensor, mask: torch.Tensor | None, scale, causal) -> tuple[float, bool]:
    """One clear error for each bad argument; returns (scale, causal) as a float and a bool."""
    check_tensor("x", x)
    check_optional_tensor("mask", mask)
    scale, causal = check_number("scale", scale), check_flag("causal", causal)
    if x.dim() < (2 if causal else 1):
        raise ValueError(f"x must have shape (..., Sq, Sk){' for causal=True' if causal else ''}, got {tuple(x.shape)}")
    check_dtype("x", x, DTYPES)
    if mask is None:
        return scale, causal
    check_dtype("mask", mask, DTYPES)
    check_same_device(x=x, mask=mask)
    try:
        broadcast = torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != x.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}")
    return scale, causal


def masked_softmax(
    x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0, causal: bool = False
) -> torch.Tensor:
    """softmax(scale * x + mask) over the last dim, optionally under the implicit causal mask;
    output in x's dtype (math in fp32).

    Rows with no visible key (every score -inf) are 0, with gradient 0, where torch.softmax gives
    NaN. Otherwise NaN and inf follow torch.softmax: a NaN or +inf score makes its whole row NaN.
    Keys hidden by ``causal`` are not read."""
    scale, causal = check_inputs(x, mask, scale, causal)
    if torch.compiler.is_compiling():
        return _forward_op(x, mask, scale, causal)
    return MaskedSoftmaxFunction.apply(x, mask, scale, causal, None)


def masked_softmax_ref(x, mask=None, *, scale=1.0, causal=False):
    """Plain PyTorch in fp32 (autograd through it): the reference the kernels are tested against."""
    return _reference(x, mask, scale, causal)
