"""Row-wise weighted sum: the smallest complete fastlm op, annotated as a template for new kernels.

    y[r] = sum_d x[r, d] * w[d]          x (..., D), w (D,), y (...)
    dx[r, d] = dy[r] * w[d]
    dw[d] = sum_r dy[r] * x[r, d]

docs/writing_an_op.md walks through this file top to bottom. Every op in fastlm/ops has the same
five parts, in this order:
  1. kernels (`@triton.jit`), with the shapes of every pointer argument in comments;
  2. launchers: plain Python that allocates outputs, picks block sizes and grids, and falls back
     to the PyTorch reference where Triton cannot run (CPU without TRITON_INTERPRET=1, or while
     torch.compile traces a CPU call);
  3. a `torch.library.triton_op` per direction: torch.compile traces through it, so the graph has
     no break and Inductor launches the kernels from the code it generates (no Python call per
     launch). There the launchers call `wrap_triton(_the_kernel)`, spelled out with the kernel's
     global name so that torch finds the kernel and keys its compile caches on the kernel source;
     eager calls launch the kernel directly;
  4. autograd: `register_autograd` for the op, and an `autograd.Function` for eager calls
     (cheaper to dispatch), both calling the same launchers;
  5. the public function: input checks with errors that name the argument, then dispatch; and a
     `*_ref` reference in plain PyTorch that the tests compare against.

Bytes (element size s, R rows): forward R D s read + R s written; backward R D s + R s read,
R D s written (dx), plus the (R / BLOCK_ROWS, D) fp32 partial sums written and read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from fastlm.ops.common import as_rows, cdiv, check_dtype, check_same_device, next_power_of_2, runs_triton

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_ROWS = 16  # rows per program: enough bytes in flight per program, few weight-gradient partials


# ----------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weighted_sum_forward_kernel(
    X,  # (R, D) rows, row stride stride_x, unit column stride
    W,  # (D,)
    Y,  # (R,) output
    R, D, stride_x,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per step of the loop over D (a power of two)
):  # fmt: skip
    # Each program owns BLOCK_R rows and walks along D in BLOCK_D-wide steps, accumulating in fp32.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: R * D may pass 2^31
    row_mask = rows < R
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        # masked lanes load 0, so the partial last block adds nothing
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(W + cols, mask=col_mask, other=0.0)
        total += tl.sum(x.to(tl.float32) * w.to(tl.float32)[None, :], axis=1)
    tl.store(Y + rows, total.to(Y.dtype.element_ty), mask=row_mask)


@triton.jit
def _weighted_sum_backward_kernel(
    X,  # (R, D) forward input, row stride stride_x
    W,  # (D,)
    DY,  # (R,) upstream gradient
    DX,  # (R, D) input gradient, contiguous
    DW_PARTIAL,  # (programs, D) fp32: this program's sum over its rows of dy[r] * x[r, :]
    R, D, stride_x,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    dy = tl.load(DY + rows, mask=row_mask, other=0.0).to(tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        mask = row_mask[:, None] & col_mask[None, :]
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * D + cols[None, :], (dy[:, None] * w[None, :]).to(DX.dtype.element_ty), mask=mask)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # No atomics: each program writes its own partial row; the launcher sums the rows, so the
        # result does not depend on the order programs finish in (deterministic).
        tl.store(DW_PARTIAL + pid * D + cols, tl.sum(dy[:, None] * x, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------


def _block_d(d: int) -> int:
    return max(1, min(next_power_of_2(d), 1024))  # D = 0: the loop over D runs no step


def _forward(x: torch.Tensor, w: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """y (x's shape without the last dim); ``traced`` inside the triton_op."""
    rows, w = as_rows(x), w.contiguous()  # the kernels read w with unit stride
    r, d = rows.shape
    y = torch.empty(r, dtype=x.dtype, device=x.device)
    if not runs_triton(x):
        return y.copy_(rows.float() @ w.float()).view(x.shape[:-1])
    if r > 0:
        kernel = wrap_triton(_weighted_sum_forward_kernel) if traced else _weighted_sum_forward_kernel
        kernel[(cdiv(r, BLOCK_ROWS),)](rows, w, y, r, d, rows.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_d(d))
    return y.view(x.shape[:-1])


def _backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, weight_grad: bool, traced: bool = False):
    """(dx like x, dw (D,) or None)."""
    rows, dy_rows, w = as_rows(x), dy.reshape(-1).contiguous(), w.contiguous()
    r, d = rows.shape
    if not runs_triton(x):
        dx = (dy_rows.float()[:, None] * w.float()[None, :]).to(x.dtype)
        dw = (dy_rows.float() @ rows.float()).to(w.dtype) if weight_grad else None
        return dx.view(x.shape), dw
    programs = cdiv(r, BLOCK_ROWS)
    dx = torch.empty((r, d), dtype=x.dtype, device=x.device)
    partial = torch.zeros((max(programs, 1), d), dtype=torch.float32, device=x.device)  # zeros: R = 0 has no program
    if r > 0:
        kernel = wrap_triton(_weighted_sum_backward_kernel) if traced else _weighted_sum_backward_kernel
        kernel[(programs,)](
            rows, w, dy_rows, dx, partial, r, d, rows.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_d(d)
        )
    return dx.view(x.shape), (partial.sum(dim=0).to(w.dtype) if weight_grad else None)


# ----------------------------------------------------------------------------------------------
# 3. torch.library ops: what torch.compile traces (running the launchers on fake tensors gives
#    the output shapes, so no separate fake implementation is needed)
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::weighted_sum_forward", mutates_args=())
def _forward_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _forward(x, w, traced=True)


@torch.library.triton_op("fastlm::weighted_sum_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, w, weight_grad=True, traced=True)


# ----------------------------------------------------------------------------------------------
# 4. Autograd: the compiled path (register_autograd) and the eager path (autograd.Function)
# ----------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and w: the backward needs both


def _op_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = _backward_op(dy, x, w)
    return dx, (dw if ctx.needs_input_grad[1] else None)


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_setup_context)


class WeightedSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _forward(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return _backward(dy, x, w, weight_grad=ctx.needs_input_grad[1])


# ----------------------------------------------------------------------------------------------
# 5. Public API and reference
# ----------------------------------------------------------------------------------------------


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of x * w: x (..., D), w (D,) -> (...), in x's dtype (fp32 math)."""
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the summed one)")
    if w.shape != x.shape[-1:]:
        raise ValueError(f"w must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, got {tuple(w.shape)}")
    check_dtype("x", x, DTYPES)
    check_dtype("w", w, DTYPES)
    check_same_device(x=x, w=w)
    if torch.compiler.is_compiling():
        return _forward_op(x, w)
    return WeightedSumFunction.apply(x, w)


def weighted_sum_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(dim=-1)
