"""Row-wise weighted sum: the smallest complete fastlm op, annotated as a template for new kernels.

    y[r] = sum_d x[r, d] * w[d]          x (..., D), w (D,), y (...)
    dx[r, d] = dy[r] * w[d]
    dw[d] = sum_r dy[r] * x[r, d]

docs/writing_an_op.md walks through this file top to bottom. Every op in fastlm/ops has the same
parts, in this order:
  1. kernels (`@triton.jit`), with the shapes of every pointer argument in comments;
  2. launch configuration: a frozen dataclass holding every launch knob (tiles, warps) and one
     cached function that picks it from (GPU architecture, dtype, the sizes that matter), with a
     default for GPUs nobody measured; tests and tuning scripts pass configurations, they never
     overwrite module globals;
  3. launchers, one per direction: plain Python that allocates outputs, picks grids and launches,
     or falls back to the PyTorch reference where Triton cannot run (CPU without
     TRITON_INTERPRET=1, or while torch.compile traces a CPU call). Each kernel launches through
     its `launcher(_the_kernel)`, made once at import: eager calls launch the compiled binary
     directly (little Python per call), inside the triton_op it hands the kernel to Inductor
     (`wrap_triton`), which launches it from its generated code;
  4. a `torch.library.triton_op` per direction: torch.compile traces through it, so the graph has
     no break and Inductor launches the kernels from the code it generates (no Python per launch);
  5. autograd: `register_autograd` for the ops, and an `autograd.Function` for eager calls (cheaper
     to dispatch), both calling the same launchers;
  6. the public function: input checks with errors that name the argument, then dispatch; and a
     `*_ref` reference in plain PyTorch that the tests compare against.

Bytes (element size s, R rows): forward R D s read + R s written; backward R D s + R s read,
R D s written (dx), plus the (R / block_rows, D) fp32 partial sums written and read back.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastlm.ops.common import (
    DTYPES,
    cdiv,
    check_dtype,
    check_same_device,
    check_tensor,
    device_arch,
    next_power_of_2,
    runs_triton,
)
from fastlm.ops.launch import launcher

# ----------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weighted_sum_forward_kernel(
    X,  # (R, D) rows, strides (stride_xr, stride_xd)
    W,  # (D,), stride stride_w
    Y,  # (R,) output, contiguous
    R, D, stride_xr, stride_xd, stride_w,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per step of the loop over D (a power of two)
):  # fmt: skip
    # Each program owns BLOCK_R rows and walks along D in BLOCK_D-wide steps, accumulating in fp32.
    # Unit strides cost nothing: Triton compiles a stride equal to 1 as the constant 1.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: R * D may pass 2^31
    row_mask = rows < R
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        # masked lanes load 0, so the partial last block adds nothing
        x = tl.load(
            X + rows[:, None] * stride_xr + cols[None, :] * stride_xd,
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        w = tl.load(W + cols * stride_w, mask=col_mask, other=0.0)
        total += tl.sum(x.to(tl.float32) * w.to(tl.float32)[None, :], axis=1)
    tl.store(Y + rows, total.to(Y.dtype.element_ty), mask=row_mask)


@triton.jit
def _weighted_sum_backward_kernel(
    X,  # (R, D) forward input, strides (stride_xr, stride_xd)
    W,  # (D,), stride stride_w
    DY,  # (R,) upstream gradient, stride stride_dy
    DX,  # (R, D) input gradient, contiguous
    DW_PARTIAL,  # (programs, D) fp32: this program's sum over its rows of dy[r] * x[r, :]; unused without WEIGHT_GRAD
    R, D, stride_xr, stride_xd, stride_w, stride_dy,
    WEIGHT_GRAD: tl.constexpr,  # whether to write DW_PARTIAL (False: w is frozen, x is not even read)
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    dy = tl.load(DY + rows * stride_dy, mask=row_mask, other=0.0).to(tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        mask = row_mask[:, None] & col_mask[None, :]
        w = tl.load(W + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * D + cols[None, :], (dy[:, None] * w[None, :]).to(DX.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            x = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xd, mask=mask, other=0.0)
            # No atomics: each program writes its own partial row; the launcher sums the rows, so the
            # result does not depend on the order programs finish in (deterministic).
            tl.store(DW_PARTIAL + pid * D + cols, tl.sum(dy[:, None] * x.to(tl.float32), axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# 2. Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightedSumConfig:
    """How both kernels tile x (R, D). Frozen, so it can key caches; make a variant with
    `dataclasses.replace(config, block_rows=4)`."""

    block_rows: int  # rows per program (BLOCK_R, a power of two): enough bytes in flight, few dw partials
    block_d_max: int  # widest column step (a power of two): BLOCK_D = next_power_of_2(D) up to this

    def block_d(self, d: int) -> int:
        """BLOCK_D for rows D wide (1 for D = 0, where the loop over D runs no step). Bit operations
        and comparisons only, so a traced, symbolic D passes through."""
        return max(1, min(next_power_of_2(d), self.block_d_max))


# By device_arch. H100 / H200 (90): not swept yet; a tuning script would replace this entry.
_CONFIGS = {90: WeightedSumConfig(block_rows=16, block_d_max=1024)}
DEFAULT_CONFIG = _CONFIGS[90]  # GPUs nobody measured, and the interpreter (0)


@functools.cache
def weighted_sum_config(arch: int, dtype: torch.dtype) -> WeightedSumConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`: 90 for H100 / H200, 0
    for the interpreter) and input ``dtype``; no entry depends on the dtype yet. Cached, so a call
    costs one dict lookup. Key it on Python values only: inside a triton_op traced with dynamic
    shapes, sizes are SymInts, which cannot be hashed; the config applies sizes afterwards
    (`WeightedSumConfig.block_d`)."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# 3. Launchers: one per direction, shared by the eager autograd.Function and the triton_op
# ----------------------------------------------------------------------------------------------

_launch_weighted_sum_forward = launcher(_weighted_sum_forward_kernel)
_launch_weighted_sum_backward = launcher(_weighted_sum_backward_kernel)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., D) -> (R, D), a view when the layout allows; any strides (the kernels take them)."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: D may be 0


def _forward(x: torch.Tensor, w: torch.Tensor, config: WeightedSumConfig | None = None, traced: bool = False):
    """y (x's shape without the last dim); ``config`` None picks it; ``traced`` inside the triton_op."""
    rows = _as_rows(x)
    r, d = rows.shape
    y = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)  # contiguous: the kernel's (R,)
    if not runs_triton(x):
        return y.copy_((rows.float() @ w.float()).view(y.shape))
    if r == 0:
        return y
    config = config or weighted_sum_config(device_arch(x.device), x.dtype)
    grid = (cdiv(r, config.block_rows),)
    block_d = config.block_d(d)
    # runtime arguments positionally, constexprs and options by keyword: the direct launch needs that
    _launch_weighted_sum_forward(traced)[grid](
        rows, w, y, r, d, *rows.stride(), w.stride(0), BLOCK_R=config.block_rows, BLOCK_D=block_d
    )
    return y


def _backward(dy, x, w, weight_grad: bool, config: WeightedSumConfig | None = None, traced: bool = False):
    """(dx like x, dw (D,) or None); ``config`` None picks it; ``traced`` inside the triton_op. dw
    costs up to two launches after the kernel: the sum of the partials, and the cast to w's dtype."""
    rows, dy_rows = _as_rows(x), (dy if dy.dim() == 1 else dy.reshape(-1))
    r, d = rows.shape
    if not runs_triton(x):
        dx = (dy_rows.float()[:, None] * w.float()[None, :]).to(x.dtype)
        dw = (dy_rows.float() @ rows.float()).to(w.dtype) if weight_grad else None
        return dx.view(x.shape), dw
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: the kernel's (R, D)
    if r == 0:  # no program runs: dw is a sum over no rows
        return dx, (w.new_zeros(d) if weight_grad else None)
    config = config or weighted_sum_config(device_arch(x.device), x.dtype)
    programs = cdiv(r, config.block_rows)
    block_d = config.block_d(d)
    # every program writes its whole row of partials, so empty suffices
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device) if weight_grad else dx
    _launch_weighted_sum_backward(traced)[(programs,)](
        rows,
        w,
        dy_rows,
        dx,
        partial,
        r,
        d,
        *rows.stride(),
        w.stride(0),
        dy_rows.stride(0),
        WEIGHT_GRAD=weight_grad,
        BLOCK_R=config.block_rows,
        BLOCK_D=block_d,
    )
    return dx, (partial.sum(dim=0).to(w.dtype) if weight_grad else None)


# ----------------------------------------------------------------------------------------------
# 4. torch.library ops: what torch.compile traces (running the launchers on fake tensors gives
#    the output shapes, so no separate fake implementation is needed); they take no config
#    (a schema holds tensors and plain values), so they always launch the picked one
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::weighted_sum_forward", mutates_args=())
def _forward_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _forward(x, w, traced=True)


@torch.library.triton_op("fastlm::weighted_sum_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, w, weight_grad=True, traced=True)


# ----------------------------------------------------------------------------------------------
# 5. Autograd: the compiled path (register_autograd) and the eager path (autograd.Function)
# ----------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and w: the backward needs both


def _op_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = _backward_op(dy, x, w)
    return dx, (dw if ctx.needs_input_grad[1] else None)


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_setup_context)


class WeightedSumFunction(torch.autograd.Function):
    """Eager path: ``WeightedSumFunction.apply(x, w, config)``; the inputs were checked by the
    public function, and the backward checks nothing again."""

    @staticmethod
    def forward(ctx, x, w, config):
        ctx.save_for_backward(x, w)
        ctx.config = config
        return _forward(x, w, config)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = _backward(dy, x, w, ctx.needs_input_grad[1], ctx.config)
        return dx, dw, None


# ----------------------------------------------------------------------------------------------
# 6. Public API and reference
# ----------------------------------------------------------------------------------------------


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of x * w: x (..., D), w (D,) -> (...), in x's dtype (fp32 math)."""
    check_tensor("x", x)
    check_tensor("w", w)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the summed one)")
    if w.shape != x.shape[-1:]:
        raise ValueError(f"w must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, got {tuple(w.shape)}")
    check_dtype("x", x, DTYPES)
    check_dtype("w", w, DTYPES)
    check_same_device(x=x, w=w)
    if torch.compiler.is_compiling():
        return _forward_op(x, w)
    return WeightedSumFunction.apply(x, w, None)


def weighted_sum_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(dim=-1)
