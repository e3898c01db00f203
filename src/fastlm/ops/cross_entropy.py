"""Fused cross-entropy over large vocabularies: Triton kernels, launchers, autograd, public API.

Math, per row x (V logits) with target t, label smoothing eps and z-loss weight z:

    lse    = log(sum_j exp(x_j))                              (computed online, base 2)
    loss   = lse - (1 - eps) * x_t - (eps / V) * sum_j x_j + z * lse**2
    dloss/dx_j = p_j * (1 + 2 z lse) - (1 - eps) * [j == t] - eps / V,   p_j = exp(x_j - lse)

Rows whose target equals ``ignore_index`` have loss 0 and gradient 0 (torch semantics).

Cost model (B rows, V classes, logits of ``s`` bytes; fastlm.analysis.xent has the full version):
    forward    reads s*B*V, writes 8*B (loss + lse)               -> one pass over the logits
    backward   reads s*B*V, writes s*B*V (recomputes p from lse) -> one read + one write
    fused      loss and gradient in one kernel; reads each row twice (statistics, then gradient)
               and writes s*B*V. The design aims for the second read to hit L2, but measured on
               an H200 it mostly misses (docs/cross_entropy.md, journal item 5).
PyTorch eager writes log-probabilities, then a zero-filled one-hot-sized gradient, then the
softmax gradient: about 3x the bytes (docs/cross_entropy.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastlm.ops.common import cdiv, check_dtype, check_same_device, multiprocessors, next_power_of_2, runs_triton

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Start value of the running max (in log2 units). Finite, so that exp2(m_old - m_new) is 0 and not
# NaN when a whole block is -inf (e.g. masked-out vocabulary entries).
RUNNING_MAX_START = tl.constexpr(-3.0e38)

REDUCTIONS = ("none", "mean", "sum")
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _row_statistics(
    row_ptr,  # pointer to x[row, 0]
    stride_col,  # elements between x[row, j] and x[row, j + 1]
    V,  # number of classes
    BLOCK_V: tl.constexpr,  # columns per step
    NEED_SUM: tl.constexpr,  # also return sum_j x_j (label smoothing needs it)
    KEEP_IN_L2: tl.constexpr,  # the row is read again soon (fused kernel): ask L2 to keep it
):
    """One pass over a row: returns (lse, sum_x) in fp32; sum_x is 0.0 unless NEED_SUM.

    Online softmax with a per-block scalar max: one exp2 per element plus two block reductions
    per step, so the special-function unit stays well under its limit at full bandwidth.
    """
    offs = tl.arange(0, BLOCK_V)
    running_max = RUNNING_MAX_START  # log2 units
    running_sum = 0.0  # sum of exp2(x * LOG2E - running_max)
    sum_x = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        if KEEP_IN_L2:
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=-float("inf"), eviction_policy="evict_last")
        else:
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=-float("inf"))
        x2 = x.to(tl.float32) * LOG2E
        new_max = tl.maximum(running_max, tl.max(x2, axis=0))
        running_sum = running_sum * tl.exp2(running_max - new_max) + tl.sum(tl.exp2(x2 - new_max), axis=0)
        running_max = new_max
        if NEED_SUM:
            sum_x += tl.sum(tl.where(mask, x.to(tl.float32), 0.0), axis=0)
    lse = (running_max + tl.log2(running_sum)) * LN2
    return lse, sum_x


@triton.jit
def _row_loss(lse, sum_x, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """loss = lse - (1 - eps) x_t - (eps / V) sum_j x_j + z lse^2 (fp32 scalars)."""
    if HAS_SMOOTHING:
        loss = lse - (1.0 - label_smoothing) * x_target - label_smoothing * sum_x / V
    else:
        loss = lse - x_target
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    return loss


@triton.jit
def _row_grad(x, cols, target, lse, V, label_smoothing, z_loss, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """dloss/dx for one block of a row, fp32: p (1 + 2 z lse) - (1 - eps) onehot - eps / V."""
    p = tl.exp2(x * LOG2E - lse * LOG2E)
    if HAS_Z_LOSS:
        p = p * (1.0 + 2.0 * z_loss * lse)
    if HAS_SMOOTHING:
        return p - tl.where(cols == target, 1.0 - label_smoothing, 0.0) - label_smoothing / V
    return p - tl.where(cols == target, 1.0, 0.0)


@triton.jit
def _target_logit(row_ptr, stride_col, target, ignore_index, V):
    """(x_t in fp32, row ignored?, target invalid?). Never reads outside the row."""
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(row_ptr + target * stride_col, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    return x_target, ignored, ~ignored & ~in_range


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr,  # (B, V) logits, any float dtype
    stride_row,  # elements between rows (>= V for padded rows; any value for views)
    stride_col,  # elements between columns (1 when rows are contiguous; Triton specializes it)
    targets_ptr,  # (B,) int32/int64 class indices
    stride_target,
    losses_ptr,  # (B,) fp32 out: per-row loss; 0 for ignored rows, NaN for invalid targets
    lse_ptr,  # (B,) fp32 out: logsumexp per row, saved for the backward
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_V: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """One program per row; reads the row once (s*V bytes), writes 8 bytes."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row * stride_target).to(tl.int64)
    lse, sum_x = _row_statistics(row_ptr, stride_col, V, BLOCK_V, HAS_SMOOTHING, False)
    x_target, ignored, invalid = _target_logit(row_ptr, stride_col, target, ignore_index, V)
    loss = _row_loss(lse, sum_x, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
    loss = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), loss))
    tl.store(losses_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_backward_kernel(
    logits_ptr,  # (B, V) logits
    stride_row,
    stride_col,
    targets_ptr,  # (B,) class indices
    stride_target,
    lse_ptr,  # (B,) fp32 logsumexp from the forward
    grad_losses_ptr,  # (B,) fp32 upstream gradient of each row's loss (stride 0 when expanded)
    stride_grad_losses,
    grad_logits_ptr,  # (B, V) out, contiguous, logits' dtype
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_V: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """Grid (B, cdiv(V, BLOCK_V)): no reduction, so each program owns one block of one row.
    Reads s*BLOCK_V bytes and writes s*BLOCK_V bytes."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    target = tl.load(targets_ptr + row * stride_target).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    grad_loss = tl.load(grad_losses_ptr + row * stride_grad_losses).to(tl.float32)
    x = tl.load(logits_ptr + row * stride_row + cols * stride_col, mask=mask, other=0.0).to(tl.float32)
    grad = grad_loss * _row_grad(x, cols, target, lse, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
    ignored = target == ignore_index
    invalid = ~ignored & ((target < 0) | (target >= V))
    grad = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), grad))
    tl.store(grad_logits_ptr + row * V + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_fused_kernel(
    logits_ptr,  # (B, V) logits
    stride_row,
    stride_col,
    targets_ptr,  # (B,) class indices
    stride_target,
    row_scale_ptr,  # (B,) fp32 factor on each row's loss and gradient (if HAS_ROW_SCALE)
    stride_row_scale,  # 0 when one factor serves all rows (1 / n_valid of a mean)
    losses_ptr,  # (B,) fp32 out: row_scale * loss
    grad_ptr,  # (B, V) out: row_scale * dloss/dx, logits' dtype; may be logits_ptr (in place)
    stride_grad_row,
    stride_grad_col,
    B,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_V: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
):
    """Persistent: program p handles rows p, p + P, ... (P programs). Per row, pass 1 computes
    lse and the loss, pass 2 writes the gradient.

    Pass 2 walks the row from its end, whose blocks pass 1 read last, with L2 eviction hints, so
    that the re-read can hit L2; on an H200 it mostly does not (docs/cross_entropy.md, item 5).
    Writing in place is safe: each block is read before the same program overwrites it.
    """
    offs = tl.arange(0, BLOCK_V)
    num_blocks = tl.cdiv(V, BLOCK_V)
    for row32 in range(tl.program_id(0), B, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_ptr + row * stride_grad_row
        target = tl.load(targets_ptr + row * stride_target).to(tl.int64)
        lse, sum_x = _row_statistics(row_ptr, stride_col, V, BLOCK_V, HAS_SMOOTHING, True)
        x_target, ignored, invalid = _target_logit(row_ptr, stride_col, target, ignore_index, V)
        loss = _row_loss(lse, sum_x, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
        scale = 1.0
        if HAS_ROW_SCALE:
            scale = tl.load(row_scale_ptr + row * stride_row_scale)
        # ignored rows: 0 * scale, so a mean over zero valid rows is NaN as in torch
        loss = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), loss)) * scale
        tl.store(losses_ptr + row, loss)
        for i in range(0, num_blocks):
            cols = (num_blocks - 1 - i) * BLOCK_V + offs
            mask = cols < V
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=0.0, eviction_policy="evict_first")
            grad = scale * _row_grad(
                x.to(tl.float32), cols, target, lse, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
            )
            grad = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), grad))
            tl.store(
                grad_row_ptr + cols * stride_grad_col,
                grad.to(grad_ptr.dtype.element_ty),
                mask=mask,
                eviction_policy="evict_first",
            )


@triton.jit
def _scale_rows_kernel(
    grad_ptr,  # (B, V) gradient from the fused kernel, scaled in place
    stride_grad_row,
    stride_grad_col,
    grad_losses_ptr,  # (B,) upstream gradient of each row's loss
    stride_grad_losses,
    V,
    BLOCK_V: tl.constexpr,
):
    """grad[row] *= grad_losses[row], touching memory only where the factor is not 1.

    The fused kernel assumed an upstream gradient of 1 (what `losses.sum().backward()` and our
    mean give), so in a training step every program loads one scalar and exits.
    """
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(grad_losses_ptr + row * stride_grad_losses).to(tl.float32)
    if factor != 1.0:
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        ptrs = grad_ptr + row * stride_grad_row + cols * stride_grad_col
        grad = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (grad * factor).to(grad_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def check_inputs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices (the target range: check_target_range)."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("logits and targets must be torch.Tensors")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    check_dtype("logits", logits, LOGIT_DTYPES)
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer class indices (int64), got dtype {targets.dtype}")
    check_dtype("targets", targets, TARGET_DTYPES)
    if targets.shape != logits.shape[:1]:
        raise ValueError(
            f"targets must have shape ({logits.shape[0]},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    check_same_device(logits=logits, targets=targets)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one class (vocab dimension is 0)")


def check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """On CPU, raise ValueError for a target outside [0, vocab) that is not ignore_index.

    Runs inside the ops (so also under torch.compile). On CUDA it would cost a device-to-host
    sync per call, so there the kernels write NaN loss and gradient for such a row instead:
    never an out-of-bounds access, never a silently wrong loss.
    """
    if targets.device.type != "cpu" or targets.numel() == 0:
        return
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {value}")


# Tile sizes from benchmarks/tune_xent.py on an H200 (B=4096, bf16, V in 32000, 50264, 128256).
FORWARD_BLOCK, FORWARD_WARPS = 8192, 4  # 97% of copy bandwidth at V=128256
BACKWARD_BLOCK, BACKWARD_WARPS = 4096, 4
FUSED_BLOCK, FUSED_WARPS, FUSED_PROGRAMS_PER_SM = 8192, 8, 2


def _fused_programs(logits: torch.Tensor) -> int:
    """Programs of the persistent fused kernel: few enough rows in flight for L2 to hold them."""
    if not logits.is_cuda:
        return logits.shape[0]
    return min(logits.shape[0], FUSED_PROGRAMS_PER_SM * multiprocessors(logits.device.index or 0))


def _launch_forward(logits, targets, ignore_index, label_smoothing, z_loss):
    batch, vocab = logits.shape
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    lse = torch.empty(batch, device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses, lse
    _cross_entropy_forward_kernel[(batch,)](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0), losses, lse,
        vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=min(next_power_of_2(vocab), FORWARD_BLOCK),
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0, num_warps=FORWARD_WARPS,
    )  # fmt: skip
    return losses, lse


def _launch_backward(logits, targets, lse, grad_losses, ignore_index, label_smoothing, z_loss):
    batch, vocab = logits.shape
    grad_logits = torch.empty((batch, vocab), device=logits.device, dtype=logits.dtype)
    if batch == 0:
        return grad_logits
    block = min(next_power_of_2(vocab), BACKWARD_BLOCK)
    grid = (batch, cdiv(vocab, block))
    _cross_entropy_backward_kernel[grid](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0), lse,
        grad_losses, grad_losses.stride(0), grad_logits,
        vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=block,
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0, num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    return grad_logits


def _launch_fused(logits, targets, row_scale, grad, ignore_index, label_smoothing, z_loss):
    """Loss and gradient in one kernel; ``grad`` is the output buffer (may be ``logits``)."""
    batch, vocab = logits.shape
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses
    _cross_entropy_fused_kernel[(_fused_programs(logits),)](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0),
        row_scale, 0 if row_scale is None else row_scale.stride(0),
        losses, grad, grad.stride(0), grad.stride(1),
        batch, vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=min(next_power_of_2(vocab), FUSED_BLOCK),
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0, HAS_ROW_SCALE=row_scale is not None,
        num_warps=FUSED_WARPS,
    )  # fmt: skip
    return losses


def _launch_scale_rows(grad, grad_losses):
    batch, vocab = grad.shape
    if batch == 0:
        return
    block = min(next_power_of_2(vocab), BACKWARD_BLOCK)
    grid = (batch, cdiv(vocab, block))
    _scale_rows_kernel[grid](
        grad, grad.stride(0), grad.stride(1), grad_losses, grad_losses.stride(0), vocab,
        BLOCK_V=block, num_warps=BACKWARD_WARPS,
    )  # fmt: skip


# Reference-path equivalents of the launchers (CPU without the interpreter): same outputs,
# computed in fp32 by plain PyTorch through cross_entropy_ref.


def _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss):
    losses = cross_entropy_ref(
        logits, targets, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing, z_loss=z_loss
    )
    return losses.float(), torch.logsumexp(logits.float(), dim=-1)


def _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss):
    """The module docstring's gradient formula in fp32 PyTorch (autograd is off inside ops)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    valid = targets != ignore_index
    onehot = F.one_hot(torch.where(valid, targets, 0).long(), x.shape[1]).float()
    grad = torch.exp(x - lse) * (1.0 + 2.0 * z_loss * lse) - (1.0 - label_smoothing) * onehot
    grad = grad - label_smoothing / x.shape[1]
    grad = torch.where(valid[:, None], grad * grad_losses.float()[:, None], 0.0)
    return grad.to(logits.dtype)


def _forward(logits, targets, ignore_index, label_smoothing, z_loss):
    """(losses, lse) through the kernels or the reference path."""
    check_target_range(targets, logits.shape[1], ignore_index)
    if runs_triton(logits):
        return _launch_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    return _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)


def _backward(logits, targets, lse, grad_losses, ignore_index, label_smoothing, z_loss):
    if runs_triton(logits):
        return _launch_backward(logits, targets, lse, grad_losses, ignore_index, label_smoothing, z_loss)
    return _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss)


def _scale_rows(grad, grad_losses):
    if runs_triton(grad):
        _launch_scale_rows(grad, grad_losses)
    else:
        grad.mul_(grad_losses.to(grad.dtype)[:, None])


def _mean_row_scale(targets, ignore_index):
    """(B,) stride-0 fp32 view of 1 / n_valid, made on device without a host sync (inf when
    n_valid is 0)."""
    return (1.0 / (targets != ignore_index).sum().float()).expand(targets.shape[0])


def _fused(logits, targets, row_scale, grad, ignore_index, label_smoothing, z_loss):
    """Dispatch of the fused pass: Triton, or the reference path writing into ``grad``."""
    check_target_range(targets, logits.shape[1], ignore_index)
    if runs_triton(logits):
        return _launch_fused(logits, targets, row_scale, grad, ignore_index, label_smoothing, z_loss)
    scale = torch.ones(logits.shape[0], device=logits.device) if row_scale is None else row_scale
    losses, _ = _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    grad.copy_(_reference_grad(logits, targets, scale, ignore_index, label_smoothing, z_loss))
    return losses * scale


# ----------------------------------------------------------------------------------------------
# torch.library ops and autograd
#
# Unlike the other fastlm ops these are custom_ops, opaque to Inductor, not triton_ops that it
# traces through: a model calls its loss once per step, so the Python call per launch costs
# little, and on CPU the target-range check reads the targets' values, which a trace cannot.
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, lse), both (B,) fp32."""
    return _forward(logits, targets, ignore_index, label_smoothing, z_loss)


@_forward_op.register_fake
def _(logits, targets, ignore_index, label_smoothing, z_loss):
    batch = logits.shape[0]
    return logits.new_empty(batch, dtype=torch.float32), logits.new_empty(batch, dtype=torch.float32)


@torch.library.custom_op("fastlm::cross_entropy_backward", mutates_args=())
def _backward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_losses: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """dlogits (B, V) in logits' dtype, recomputing softmax from the saved lse."""
    return _backward(logits, targets, lse, grad_losses, ignore_index, label_smoothing, z_loss)


@_backward_op.register_fake
def _(logits, targets, lse, grad_losses, ignore_index, label_smoothing, z_loss):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _forward_setup_context(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing, z_loss = inputs
    _, lse = output
    ctx.save_for_backward(logits, targets, lse)
    ctx.options = (ignore_index, label_smoothing, z_loss)
    ctx.mark_non_differentiable(lse)


def _forward_backward(ctx, grad_losses, _grad_lse):
    logits, targets, lse = ctx.saved_tensors
    grad_logits = _backward_op(logits, targets, lse, grad_losses, *ctx.options)
    return grad_logits, None, None, None, None


torch.library.register_autograd(_forward_op, _forward_backward, setup_context=_forward_setup_context)


@torch.library.custom_op("fastlm::cross_entropy_fused", mutates_args=())
def _fused_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float, mean: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, dlogits). With ``mean`` both are pre-scaled by 1 / n_valid, so that the mean is
    ``losses.sum()`` and the upstream gradient of every row is exactly 1."""
    row_scale = _mean_row_scale(targets, ignore_index) if mean else None
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    losses = _fused(logits, targets, row_scale, grad, ignore_index, label_smoothing, z_loss)
    return losses, grad


@_fused_op.register_fake
def _(logits, targets, ignore_index, label_smoothing, z_loss, mean):
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return logits.new_empty(logits.shape[0], dtype=torch.float32), grad


@torch.library.custom_op("fastlm::cross_entropy_scale_rows_", mutates_args=("grad",))
def _scale_rows_op(grad: torch.Tensor, grad_losses: torch.Tensor) -> None:
    """grad[i] *= grad_losses[i] in place; free when every factor is 1."""
    _scale_rows(grad, grad_losses)


@_scale_rows_op.register_fake
def _(grad, grad_losses):
    return None


def _fused_setup_context(ctx, inputs, output):
    # The gradient is kept as an attribute, not saved: backward scales it in place, which would
    # trip the saved-tensor version check. It is non-differentiable, so it has no grad_fn and
    # holding it here makes no reference cycle.
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.grad = grad


def _take_fused_grad(ctx) -> torch.Tensor:
    """The gradient computed in the forward; a second backward through the same graph would
    see it already scaled, so it is handed out once."""
    grad = ctx.grad
    if grad is None:
        raise RuntimeError(
            "the fused cross-entropy's backward can run only once per forward (retain_graph=True "
            "reuse is not supported); use fastlm.cross_entropy(..., fused=False) for that"
        )
    ctx.grad = None
    return grad


def _fused_backward(ctx, grad_losses, _grad_grad):
    grad = _take_fused_grad(ctx)
    _scale_rows_op(grad, grad_losses)
    return grad, None, None, None, None, None


torch.library.register_autograd(_fused_op, _fused_backward, setup_context=_fused_setup_context)


# Eager autograd: the same launchers behind plain autograd.Functions. A torch.library op costs
# tens of microseconds of Python per call, as much as the whole kernel at V=32000, so eager code
# takes these and only torch.compile traces the ops above.


class CrossEntropyFunction(torch.autograd.Function):
    """Recompute path: forward saves (logits, targets, lse); backward recomputes softmax."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss):
        losses, lse = _forward(logits, targets, ignore_index, label_smoothing, z_loss)
        ctx.save_for_backward(logits, targets, lse)
        ctx.options = (ignore_index, label_smoothing, z_loss)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        logits, targets, lse = ctx.saved_tensors
        return _backward(logits, targets, lse, grad_losses, *ctx.options), None, None, None, None


class CrossEntropyFusedFunction(torch.autograd.Function):
    """Fused path: the forward writes dlogits, the backward hands it out (scaled if needed).

    With ``inplace`` the gradient overwrites the logits. Their version counter is bumped, so
    any op that saved the logits for its own backward fails loudly at backward time instead of
    computing with overwritten values.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, mean, inplace):
        row_scale = _mean_row_scale(targets, ignore_index) if mean else None
        grad = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
        losses = _fused(logits, targets, row_scale, grad, ignore_index, label_smoothing, z_loss)
        if inplace:
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad  # not saved_tensors: backward scales it in place
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad = _take_fused_grad(ctx)
        _scale_rows(grad, grad_losses)
        return grad, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    fused: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, V) against class indices ``targets`` (B,).

    Same values as ``torch.nn.functional.cross_entropy`` (ignore_index, reduction,
    label_smoothing; a mean over zero valid rows is NaN), plus ``z_loss * logsumexp**2`` added per
    non-ignored row. Losses are returned in fp32 whatever the logits' dtype.

    Args:
        fused: when the logits require grad, compute the gradient in the forward pass (one
            kernel reads the logits, writes loss and dlogits) and keep it until backward. Costs
            one (B, V) buffer between forward and backward; ``False`` recomputes the softmax in
            backward from the saved logsumexp instead (one more read of the logits).
        inplace: with ``fused``, write the gradient over the logits' storage (saves that
            buffer). The logits are destroyed; they must not be a leaf tensor; eager only.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if inplace and not fused:
        raise ValueError("inplace=True needs fused=True: only the fused path writes the gradient in the forward")
    check_inputs(logits, targets)
    options = (int(ignore_index), float(label_smoothing), float(z_loss))
    mean = reduction == "mean"
    compiling = torch.compiler.is_compiling()

    if fused and logits.requires_grad and torch.is_grad_enabled() and logits.shape[0] > 0:
        if inplace and logits.is_leaf:
            raise ValueError("inplace=True overwrites logits with their gradient, so logits must not be a leaf tensor")
        if inplace and compiling:
            raise ValueError("inplace=True works in eager mode only; under torch.compile use inplace=False")
        if compiling:
            losses, _ = _fused_op(logits, targets, *options, mean)
        else:
            losses = CrossEntropyFusedFunction.apply(logits, targets, *options, mean, inplace)
        return losses if reduction == "none" else losses.sum()

    if compiling:
        losses, _ = _forward_op(logits, targets, *options)
    else:
        losses = CrossEntropyFunction.apply(logits, targets, *options)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row losses, (B, V) logits and (B,) int64 targets -> (B,) float32 (reduction='none')."""
    check_inputs(logits, targets)
    return _forward(logits, targets, -100, 0.0, 0.0)[0]


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """dlogits for per-row losses: (B, V), (B,) int64, (B,) float32 upstream -> (B, V) logits' dtype.

    Needs no saved state: one kernel computes each row's logsumexp and then its gradient.
    """
    check_inputs(logits, targets)
    if grad_output.shape != targets.shape:
        raise ValueError(f"grad_output must have shape {tuple(targets.shape)}, got {tuple(grad_output.shape)}")
    check_same_device(logits=logits, grad_output=grad_output)
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    _fused(logits, targets, grad_output.float(), grad, -100, 0.0, 0.0)
    return grad


def cross_entropy_ref(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Plain-PyTorch reference with the semantics of ``cross_entropy``, in fp32 (fp64 stays fp64)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(
        x, targets.long(), ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = targets != ignore_index
    if z_loss > 0:
        losses = losses + torch.where(valid, z_loss * torch.logsumexp(x, dim=-1) ** 2, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()
