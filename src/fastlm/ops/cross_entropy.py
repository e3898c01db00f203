"""Fused cross-entropy over large vocabularies: Triton kernels, launchers, autograd, public API.

Math, per row x (V logits) with target t, label smoothing eps and z-loss weight z:

    m      = max_j x_j,   s = log(sum_j exp(x_j - m)),   lse = m + s     (online, one pass)
    loss   = lse - (1 - eps) * x_t - (eps / V) * sum_j x_j + z * lse**2
           = s + (1 - eps) * (m - x_t) - (eps / V) * sum_j (x_j - m) + z * lse**2
    dloss/dx_j = p_j * (1 + 2 z lse) - (1 - eps) * [j == t] - eps / V,   p_j = exp((x_j - m) - s)

Every difference is formed before it can cancel (the second form of the loss, x_j - m before the
scaling to base 2), and the forward saves (m, s) rather than lse: with a common offset of 1e6 on
the logits, lse itself carries fp32's 0.06 rounding, which `lse - x_t` and `exp(x_j - lse)` would
turn into a loss error of 0.06 and gradients off by 6%.

Rows whose target equals ``ignore_index`` have loss 0 and gradient 0 (torch semantics).

Cost model (B rows, V classes, logits of ``s`` bytes; fastlm.analysis.xent has the full version):
    forward    reads s*B*V, writes 12*B (loss, m, s)               -> one pass over the logits
    backward   reads s*B*V, writes s*B*V (recomputes p from m, s) -> one read + one write
    fused      loss and gradient in one kernel; reads each row twice (statistics, then gradient)
               and writes s*B*V. The design aims for the second read to hit L2, but measured on
               an H200 it mostly misses (docs/notes/cross_entropy.md, item 5). For a mean each
               program also reads the 8*B bytes of targets to count the valid rows (no extra launch):
               P*8*B bytes for P programs, small against s*B*V at LM vocabularies, not at V of a few
               dozen classes (and O(B^2) work under the interpreter).
PyTorch eager writes log-probabilities, then a zero-filled one-hot-sized gradient, then the
softmax gradient: about 3x the bytes (docs/notes/cross_entropy.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import wrap_triton

from fastlm.ops.common import (
    cdiv,
    check_dtype,
    check_flag,
    check_integer,
    check_number,
    check_same_device,
    check_tensor,
    device_arch,
    may_overlap,
    multiprocessors,
    next_power_of_2,
    runs_triton,
)
from fastlm.ops.launch import eager_kernel

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

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
    NEED_SUM: tl.constexpr,  # also return sum_j (x_j - m) (label smoothing needs it)
    KEEP_IN_L2: tl.constexpr,  # the row is read again soon (fused kernel): ask L2 to keep it
):
    """One pass over a row: (m, s, shifted_sum) in fp32, m = max_j x_j, s = log(sum_j exp(x_j - m)),
    shifted_sum = sum_j (x_j - m) (0.0 unless NEED_SUM).

    Online softmax with a per-block scalar max: one exp2 per element plus two block reductions
    per step, so the special-function unit stays well under its limit at full bandwidth. x - m is
    formed before the scaling to base 2 (scaling x first would round it: by 0.06 at 1e6).
    """
    offs = tl.arange(0, BLOCK_V)
    running_max = -float("inf")
    shift = 0.0  # running_max, or 0 while every value so far is -inf (masked vocabulary entries)
    running_sum = 0.0  # sum of exp(x - shift) over the columns read so far
    shifted_sum = 0.0  # sum of (x - shift) over them
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        if KEEP_IN_L2:
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=-float("inf"), eviction_policy="evict_last")
        else:
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=-float("inf"))
        x = x.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        new_shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # -inf - -inf would be NaN
        # (running_max, not shift: exp2(-inf) = 0 rescales a sum of zeros, where exp2(0 - shift) could be inf)
        running_sum = running_sum * tl.exp2((running_max - new_shift) * LOG2E) + tl.sum(
            tl.exp2((x - new_shift) * LOG2E), axis=0
        )
        if NEED_SUM:  # the `start` columns read before, re-centred on the new shift, then this block's
            shifted_sum = shifted_sum - start * (new_shift - shift) + tl.sum(tl.where(mask, x - new_shift, 0.0), axis=0)
        running_max, shift = new_max, new_shift
    return running_max, tl.log2(running_sum) * LN2, shifted_sum


@triton.jit
def _as_fp32(label_smoothing, z_loss):
    """The float arguments in fp32: Triton's launcher passes Python floats as fp32, Inductor's
    generated code as fp64, which would turn the row math fp64 (and mismatch branch types)."""
    return tl.cast(label_smoothing, tl.float32), tl.cast(z_loss, tl.float32)


@triton.jit
def _row_loss(row_max, log_sum, shifted_sum, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING: tl.constexpr,
              HAS_Z_LOSS: tl.constexpr):  # fmt: skip
    """loss = s + (1 - eps)(m - x_t) - (eps / V) sum_j (x_j - m) + z lse^2 (fp32 scalars; the module
    docstring's second form, whose terms do not cancel)."""
    label_smoothing, z_loss = _as_fp32(label_smoothing, z_loss)
    if HAS_SMOOTHING:
        loss = log_sum + (1.0 - label_smoothing) * (row_max - x_target) - label_smoothing * shifted_sum / V
    else:
        loss = log_sum + (row_max - x_target)
    if HAS_Z_LOSS:
        lse = row_max + log_sum
        loss += z_loss * lse * lse
    return loss


@triton.jit
def _row_grad(x, cols, target, row_max, log2_sum, V, label_smoothing, z_loss, HAS_SMOOTHING: tl.constexpr,
              HAS_Z_LOSS: tl.constexpr):  # fmt: skip
    """dloss/dx for one block of a row, fp32: p (1 + 2 z lse) - (1 - eps) onehot - eps / V, with
    p = exp2((x - m) log2(e) - log2_sum) and log2_sum = s log2(e), the row's scalar."""
    label_smoothing, z_loss = _as_fp32(label_smoothing, z_loss)
    p = tl.exp2((x - row_max) * LOG2E - log2_sum)
    if HAS_Z_LOSS:
        p = p * (1.0 + 2.0 * z_loss * (row_max + log2_sum * LN2))
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
def _inverse_valid_count(targets_ptr, stride_target, B, ignore_index, COUNT_BLOCK: tl.constexpr):
    """1 / (number of targets != ignore_index) in fp32, inf when there is none: a mean's factor.

    Every program of the fused kernel counts for itself: 8 B bytes of targets, mostly from L2,
    against the s B V bytes of logits, and no other launch and no host sync. The count is an
    integer and the division correctly rounded (div_rn), so the factor is the same in every
    program and every run, equal to torch's 1 / n_valid in fp32.
    """
    count = 0
    for start in range(0, B, COUNT_BLOCK):
        rows = start + tl.arange(0, COUNT_BLOCK)
        in_batch = rows < B
        target = tl.load(targets_ptr + rows.to(tl.int64) * stride_target, mask=in_batch, other=0)
        count += tl.sum((in_batch & (target.to(tl.int64) != ignore_index)).to(tl.int32), axis=0)
    return tl.math.div_rn(tl.full((), 1.0, tl.float32), count.to(tl.float32))


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr,  # (B, V) logits, any float dtype
    stride_row,  # elements between rows (>= V for padded rows; any value for views)
    stride_col,  # elements between columns (1 when rows are contiguous; Triton specializes it)
    targets_ptr,  # (B,) int32/int64 class indices
    stride_target,
    losses_ptr,  # (B,) fp32 out: per-row loss; 0 for ignored rows, NaN for invalid targets
    stats_ptr,  # (2, B) fp32 out: per row m (row 0) and s (row 1), saved for the backward
    B,
    V,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_V: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """One program per row; reads the row once (s*V bytes), writes 12 bytes."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row * stride_target).to(tl.int64)
    row_max, log_sum, shifted_sum = _row_statistics(row_ptr, stride_col, V, BLOCK_V, HAS_SMOOTHING, False)
    x_target, ignored, invalid = _target_logit(row_ptr, stride_col, target, ignore_index, V)
    loss = _row_loss(row_max, log_sum, shifted_sum, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
    loss = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), loss))
    tl.store(losses_ptr + row, loss)
    tl.store(stats_ptr + row, row_max)
    tl.store(stats_ptr + B + row, log_sum)


@triton.jit
def _cross_entropy_backward_kernel(
    logits_ptr,  # (B, V) logits
    stride_row,
    stride_col,
    targets_ptr,  # (B,) class indices
    stride_target,
    stats_ptr,  # (2, B) fp32 m and s from the forward
    grad_losses_ptr,  # (B,) fp32 upstream gradient of each row's loss (stride 0 when expanded)
    stride_grad_losses,
    grad_logits_ptr,  # (B, V) out, contiguous, logits' dtype
    B,
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
    row_max = tl.load(stats_ptr + row)
    log2_sum = tl.load(stats_ptr + B + row) * LOG2E
    grad_loss = tl.load(grad_losses_ptr + row * stride_grad_losses).to(tl.float32)
    x = tl.load(logits_ptr + row * stride_row + cols * stride_col, mask=mask, other=0.0).to(tl.float32)
    grad = grad_loss * _row_grad(x, cols, target, row_max, log2_sum, V, label_smoothing, z_loss, HAS_SMOOTHING,
                                 HAS_Z_LOSS)  # fmt: skip
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
    stride_row_scale,  # 0 when one factor serves all rows
    losses_ptr,  # (B,) fp32 out: row_scale * loss (MEAN: loss / n_valid)
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
    MEAN: tl.constexpr,  # scale every row by 1 / n_valid, counted here (rows whose target is not ignore_index)
    COUNT_BLOCK: tl.constexpr,  # targets per step of that count
):
    """Persistent: program p handles rows p, p + P, ... (P programs). Per row, pass 1 computes
    m, s and the loss, pass 2 writes the gradient.

    Pass 2 walks the row from its end, whose blocks pass 1 read last, with L2 eviction hints, so
    that the re-read can hit L2; on an H200 it mostly does not (docs/notes/cross_entropy.md, item 5).
    Writing in place is safe: each block is read before the same program overwrites it.
    """
    offs = tl.arange(0, BLOCK_V)
    num_blocks = tl.cdiv(V, BLOCK_V)
    mean_scale = 1.0
    if MEAN:
        mean_scale = _inverse_valid_count(targets_ptr, stride_target, B, ignore_index, COUNT_BLOCK)
    for row32 in range(tl.program_id(0), B, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_ptr + row * stride_grad_row
        target = tl.load(targets_ptr + row * stride_target).to(tl.int64)
        row_max, log_sum, shifted_sum = _row_statistics(row_ptr, stride_col, V, BLOCK_V, HAS_SMOOTHING, True)
        x_target, ignored, invalid = _target_logit(row_ptr, stride_col, target, ignore_index, V)
        loss = _row_loss(row_max, log_sum, shifted_sum, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING,
                         HAS_Z_LOSS)  # fmt: skip
        log2_sum = log_sum * LOG2E
        scale = mean_scale
        if HAS_ROW_SCALE:
            scale = tl.load(row_scale_ptr + row * stride_row_scale)
        # ignored rows: 0 * scale, so a mean over zero valid rows (scale inf) is NaN as in torch
        loss = tl.where(ignored, 0.0, tl.where(invalid, float("nan"), loss)) * scale
        tl.store(losses_ptr + row, loss)
        for i in range(0, num_blocks):
            cols = (num_blocks - 1 - i) * BLOCK_V + offs
            mask = cols < V
            x = tl.load(row_ptr + cols * stride_col, mask=mask, other=0.0, eviction_policy="evict_first")
            grad = scale * _row_grad(x.to(tl.float32), cols, target, row_max, log2_sum, V, label_smoothing, z_loss,
                                     HAS_SMOOTHING, HAS_Z_LOSS)  # fmt: skip
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
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XentConfig:
    """Blocks and warps of the cross-entropy kernels. Frozen, so it can key caches; make a variant
    with `dataclasses.replace(config, fused_warps=4)`. Blocks are used as given (powers of two)."""

    forward_block: int  # BLOCK_V of the forward: columns per step of the one program per row
    forward_warps: int  # warps per forward program
    backward_block: int  # BLOCK_V of the backward and the scale-rows kernels: columns per program
    backward_warps: int  # warps per backward / scale-rows program
    fused_block: int  # BLOCK_V of the fused kernel: columns per step of both passes over a row
    fused_warps: int  # warps per fused program
    fused_programs_per_sm: int  # persistent fused grid: few enough rows in flight for L2 to hold them
    fused_count_block: int  # targets per step when each fused program counts a mean's valid rows


# From benchmarks/tune_xent.py (B=4096, bf16, V in 32000, 50264, 128256): the forward and
# backward on an H200 (benchmarks/results/xent_tuning_h200.jsonl), the fused kernel on an H100
# (xent_tuning_h100.jsonl), where 32 programs per SM, one per row at B=4096, beat the persistent
# grid of 2 per SM by 3-16%.
DEFAULT_CONFIG = XentConfig(
    forward_block=8192,
    forward_warps=4,
    backward_block=4096,
    backward_warps=4,
    fused_block=16384,
    fused_warps=8,
    fused_programs_per_sm=32,
    fused_count_block=4096,  # int64: 32 KB per step, one step up to B = 4096 (not tuned)
)
_CONFIGS = {90: DEFAULT_CONFIG}  # by device_arch; other GPUs and the interpreter take the same values


@functools.cache
def cross_entropy_config(arch: int, dtype: torch.dtype, vocab: int) -> XentConfig:
    """The launch configuration for ``vocab``-wide rows of ``dtype`` logits on GPU architecture
    ``arch`` (`device_arch`: 90 for H100 / H200, 0 for the interpreter): the table's entry (measured
    in bf16; no entry depends on the dtype yet), its blocks no wider than the row needs. Cached, so
    a call costs one dict lookup."""
    config = _CONFIGS.get(arch, DEFAULT_CONFIG)
    return replace(
        config,
        forward_block=_row_block(vocab, config.forward_block),
        backward_block=_row_block(vocab, config.backward_block),
        fused_block=_fused_row_block(vocab, config.fused_block),
    )


def _fused_row_block(vocab, widest: int):
    """`_row_block`, halved while its blocks would pad the row by more than a sixth: at V=50264 a
    16384 block pads it by 30% and measured 8% slower than 8192 (14%); 32000 and 128256 pad by
    2% at 16384. A symbolic vocab (a trace with dynamic shapes) keeps `_row_block`'s, guarding on
    nothing more."""
    block = _row_block(vocab, widest)
    while type(vocab) is int and block > 1024 and 6 * (-vocab % block) > vocab:
        block //= 2
    return block


def _row_block(vocab, widest: int):
    """``widest``, or the row rounded up to a power of two when that is narrower. Written so that
    a symbolic vocab of a trace guards on ``vocab > widest / 2`` only, which LM vocabularies pass."""
    return widest if vocab > widest // 2 else next_power_of_2(vocab)


def _picked_config(logits: torch.Tensor) -> XentConfig:
    vocab = logits.shape[1]
    # Inside a triton_op traced with dynamic shapes the vocab is a SymInt, which cannot key the
    # cache; a trace picks once, so it calls the function uncached.
    pick = cross_entropy_config if type(vocab) is int else cross_entropy_config.__wrapped__
    return pick(device_arch(logits.device), logits.dtype, vocab)


# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Functions and the triton_ops; the
# plain-PyTorch reference where Triton cannot run (CPU without the interpreter, CPU traces)
# ----------------------------------------------------------------------------------------------


def _forward(logits, targets, ignore_index, label_smoothing, z_loss, config=None, traced=False):
    """(losses (B,), stats (2, B): each row's m and s), fp32; ``config`` None picks it; ``traced``
    inside the triton_op."""
    if not runs_triton(logits):
        return _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    batch, vocab = logits.shape
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    stats = torch.empty((2, batch), device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses, stats
    config = _picked_config(logits) if config is None else config
    kernel = wrap_triton(_cross_entropy_forward_kernel) if traced else eager_kernel(_cross_entropy_forward_kernel)
    # runtime arguments positionally, constexprs and options by keyword: eager_kernel's fast path needs that
    kernel[(batch,)](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0), losses, stats,
        batch, vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=config.forward_block, HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0,
        num_warps=config.forward_warps,
    )  # fmt: skip
    return losses, stats


def _backward(logits, targets, stats, grad_losses, ignore_index, label_smoothing, z_loss, config=None, traced=False):
    """dlogits (B, V), contiguous, logits' dtype, recomputing softmax from the saved stats (m, s)."""
    if not runs_triton(logits):
        return _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss)
    batch, vocab = logits.shape
    grad_logits = torch.empty((batch, vocab), device=logits.device, dtype=logits.dtype)
    if batch == 0:
        return grad_logits
    config = _picked_config(logits) if config is None else config
    kernel = wrap_triton(_cross_entropy_backward_kernel) if traced else eager_kernel(_cross_entropy_backward_kernel)
    kernel[(batch, cdiv(vocab, config.backward_block))](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0), stats,
        grad_losses, grad_losses.stride(0), grad_logits,
        batch, vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=config.backward_block, HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0,
        num_warps=config.backward_warps,
    )  # fmt: skip
    return grad_logits


def _fused(
    logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, grad=None, config=None, traced=False
):
    """(losses, dlogits) in one kernel, both multiplied per row by ``row_scale`` (B,) if given, or
    by 1 / n_valid with ``mean``. ``grad`` is the output buffer (may be ``logits``: in place; None:
    a new contiguous one)."""
    if grad is None:
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if not runs_triton(logits):
        return _reference_fused(logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, grad)
    batch, vocab = logits.shape
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses, grad
    config = _picked_config(logits) if config is None else config
    # a few programs per SM, each striding over the rows; one per row in the interpreter
    programs = batch
    if logits.is_cuda:
        programs = min(batch, config.fused_programs_per_sm * multiprocessors(logits.get_device()))
    kernel = wrap_triton(_cross_entropy_fused_kernel) if traced else eager_kernel(_cross_entropy_fused_kernel)
    kernel[(programs,)](
        logits, logits.stride(0), logits.stride(1), targets, targets.stride(0),
        losses if row_scale is None else row_scale, 0 if row_scale is None else row_scale.stride(0),
        losses, grad, grad.stride(0), grad.stride(1),
        batch, vocab, ignore_index, label_smoothing, z_loss,
        BLOCK_V=config.fused_block, HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0,
        HAS_ROW_SCALE=row_scale is not None, MEAN=mean and row_scale is None, COUNT_BLOCK=config.fused_count_block,
        num_warps=config.fused_warps,
    )  # fmt: skip
    return losses, grad


def _scale_rows(grad, grad_losses, config=None, traced=False):
    """grad[i] *= grad_losses[i] in place (a 0-d grad_losses: one factor for all rows); on the GPU
    free (one scalar load per program) where the factor is 1."""
    if not runs_triton(grad):
        grad.copy_(grad * grad_losses.float().reshape(-1, 1))  # fp32 product, rounded once as the kernel does
        return
    batch, vocab = grad.shape
    if batch == 0:
        return
    config = _picked_config(grad) if config is None else config
    kernel = wrap_triton(_scale_rows_kernel) if traced else eager_kernel(_scale_rows_kernel)
    kernel[(batch, cdiv(vocab, config.backward_block))](
        grad, grad.stride(0), grad.stride(1), grad_losses, grad_losses.stride(0) if grad_losses.dim() else 0, vocab,
        BLOCK_V=config.backward_block, num_warps=config.backward_warps,
    )  # fmt: skip


# Reference-path equivalents of the launchers (CPU without the interpreter, and CPU traces): same
# outputs, computed in fp32 by plain PyTorch through cross_entropy_ref.


def _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss):
    losses = cross_entropy_ref(
        logits, targets, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing, z_loss=z_loss
    )
    x = logits.float()
    row_max = x.amax(dim=-1)
    return losses.float(), torch.stack([row_max, torch.logsumexp(x - row_max[:, None], dim=-1)])


def _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss):
    """The module docstring's gradient formula in fp32 PyTorch (autograd is off inside ops), times
    ``grad_losses`` (B,) unless None; p from torch.softmax, which shifts by the row max first."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    valid = targets != ignore_index
    onehot = F.one_hot(torch.where(valid, targets, 0).long(), x.shape[1]).float()
    grad = torch.softmax(x, dim=-1) * (1.0 + 2.0 * z_loss * lse) - (1.0 - label_smoothing) * onehot
    grad = grad - label_smoothing / x.shape[1]
    if grad_losses is not None:
        grad = grad * grad_losses.float()[:, None]
    return torch.where(valid[:, None], grad, 0.0).to(logits.dtype)


def _reference_fused(logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, grad):
    if row_scale is None and mean:
        row_scale = (1.0 / (targets != ignore_index).sum().float()).expand(targets.shape[0])
    losses, _ = _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    grad.copy_(_reference_grad(logits, targets, row_scale, ignore_index, label_smoothing, z_loss))
    return (losses if row_scale is None else losses * row_scale), grad


# ----------------------------------------------------------------------------------------------
# torch.library ops: what torch.compile traces (running the launchers on fake tensors gives the
# output shapes, so no separate fake implementation is needed). They take no config (a schema
# holds tensors and plain values), so they launch the picked one; they check no target range
# (that reads the targets' values: see check_target_range).
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses (B,), stats (2, B): each row's max and log-sum-exp about it), fp32."""
    return _forward(logits, targets, ignore_index, label_smoothing, z_loss, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_backward", mutates_args=())
def _backward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: torch.Tensor,
    grad_losses: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """dlogits (B, V) in logits' dtype, recomputing softmax from the saved stats."""
    return _backward(logits, targets, stats, grad_losses, ignore_index, label_smoothing, z_loss, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_fused", mutates_args=())
def _fused_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_scale: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    mean: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, dlogits), scaled per row by ``row_scale`` or, with ``mean``, by 1 / n_valid, so
    that the mean is ``losses.sum()`` and the upstream gradient of every row is exactly 1."""
    return _fused(logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_scale_rows_", mutates_args=("grad",))
def _scale_rows_op(grad: torch.Tensor, grad_losses: torch.Tensor) -> None:
    """grad[i] *= grad_losses[i] in place: out of place it would have to write all of grad, even
    where every factor is 1."""
    _scale_rows(grad, grad_losses, traced=True)


# ----------------------------------------------------------------------------------------------
# Autograd: the compiled path (register_autograd) and the eager path (autograd.Functions)
# ----------------------------------------------------------------------------------------------


def _forward_setup_context(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing, z_loss = inputs
    _, stats = output
    ctx.save_for_backward(logits, targets, stats)
    ctx.options = (ignore_index, label_smoothing, z_loss)
    ctx.mark_non_differentiable(stats)


def _forward_op_backward(ctx, grad_losses, _grad_stats):
    logits, targets, stats = ctx.saved_tensors
    grad_logits = _backward_op(logits, targets, stats, grad_losses, *ctx.options)
    return grad_logits, None, None, None, None


torch.library.register_autograd(_forward_op, _forward_op_backward, setup_context=_forward_setup_context)


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


def _fused_op_backward(ctx, grad_losses, _grad_grad):
    grad = _take_fused_grad(ctx)
    _scale_rows_op(grad, grad_losses)
    return grad, None, None, None, None, None, None


torch.library.register_autograd(_fused_op, _fused_op_backward, setup_context=_fused_setup_context)


# Eager: the same launchers behind plain autograd.Functions (a torch.library call costs tens of
# microseconds of Python, as much as the whole kernel at V=32000). The public function checked
# the inputs; the forwards check the target range (eager only), the backwards check nothing.


class CrossEntropyFunction(torch.autograd.Function):
    """Recompute path: forward saves (logits, targets, stats); backward recomputes softmax.
    ``CrossEntropyFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss, config)``."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, config):
        check_target_range(targets, logits.shape[1], ignore_index)
        config = _picked_config(logits) if config is None else config  # once for both directions
        losses, stats = _forward(logits, targets, ignore_index, label_smoothing, z_loss, config)
        ctx.save_for_backward(logits, targets, stats)
        ctx.options = (ignore_index, label_smoothing, z_loss, config)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        logits, targets, stats = ctx.saved_tensors
        return _backward(logits, targets, stats, grad_losses, *ctx.options), None, None, None, None, None


class CrossEntropyFusedFunction(torch.autograd.Function):
    """Fused path: the forward writes dlogits, the backward hands it out (scaled if needed).
    ``CrossEntropyFusedFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss,
    reduction, inplace, config)``. A "mean" or "sum" is reduced here rather than by a `.sum()`
    after it: one autograd node fewer to record and to run.

    With ``inplace`` the gradient overwrites the logits. Their version counter is bumped, so
    any op that saved the logits for its own backward fails loudly at backward time instead of
    computing with overwritten values.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, reduction, inplace, config):
        check_target_range(targets, logits.shape[1], ignore_index)
        config = _picked_config(logits) if config is None else config  # once for both directions
        mean, grad = reduction == "mean", logits if inplace else None
        losses, grad = _fused(logits, targets, None, ignore_index, label_smoothing, z_loss, mean, grad, config)
        if inplace:
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad  # not saved_tensors: backward scales it in place
        ctx.config = config
        return losses if reduction == "none" else losses.sum()  # a mean's rows came scaled by 1 / n_valid

    @staticmethod
    def backward(ctx, grad_output):
        # grad_output: (B,), or a scalar for a mean / sum. Usually 1 (`loss.backward()`), but that
        # value is on the device: skipping this launch would need a sync, so the kernel tests it.
        grad = _take_fused_grad(ctx)
        _scale_rows(grad, grad_output, ctx.config)
        return grad, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_options(ignore_index, reduction, label_smoothing, z_loss, fused, inplace) -> tuple[int, float, float]:
    """The options of `cross_entropy` (and of `fastlm.nn.CrossEntropyLoss`), one clear error for each
    bad value; returns (ignore_index, label_smoothing, z_loss) as int, float, float."""
    if not (isinstance(reduction, str) and reduction in REDUCTIONS):
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    fused, inplace = check_flag("fused", fused), check_flag("inplace", inplace)
    if inplace and not fused:
        raise ValueError("inplace=True needs fused=True: only the fused path writes the gradient in the forward")
    return (
        check_integer("ignore_index", ignore_index),
        check_number("label_smoothing", label_smoothing, 0.0, 1.0),
        check_number("z_loss", z_loss, 0.0),
    )


def check_inputs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices (the target range: check_target_range)."""
    check_tensor("logits", logits)
    check_tensor("targets", targets)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    check_dtype("logits", logits, LOGIT_DTYPES)
    check_target_dtype(targets)
    if targets.shape != logits.shape[:1]:
        raise ValueError(
            f"targets must have shape ({logits.shape[0]},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        check_same_device(logits=logits, targets=targets)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one class (vocab dimension is 0)")


def check_target_dtype(targets: torch.Tensor) -> None:
    """int64 or int32 class indices; a float, complex or bool tensor gets its own message."""
    if targets.dtype not in TARGET_DTYPES:
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"targets must hold integer class indices (int64), got dtype {targets.dtype}")
        check_dtype("targets", targets, TARGET_DTYPES)


def check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """On CPU, raise ValueError for a target outside [0, vocab) that is not ignore_index.

    Eager only (the autograd.Functions' forwards and the user-loop functions): it reads the
    targets' values, which a trace cannot; a compiled CPU call takes the reference path, where
    torch's own cross-entropy rejects such a target. On CUDA it would cost a device-to-host
    sync per call, so there the kernels write NaN loss and gradient for such a row instead:
    never an out-of-bounds access, never a silently wrong loss.
    """
    if not targets.is_cpu or targets.numel() == 0:
        return
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {value}")


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
        ignore_index: an int; rows with this target count as absent.
        fused: when the logits require grad, compute the gradient in the forward pass (one
            kernel reads the logits, writes loss and dlogits) and keep it until backward. Costs
            one (B, V) buffer between forward and backward; ``False`` recomputes the softmax in
            backward from the saved row statistics instead (one more read of the logits).
        inplace: with ``fused``, write the gradient over the logits' storage (saves that
            buffer). The logits are destroyed; they must not be a leaf tensor, nor a view whose
            elements share memory (an expanded tensor); eager only.
    """
    ignore_index, label_smoothing, z_loss = check_options(ignore_index, reduction, label_smoothing, z_loss, fused,
                                                          inplace)  # fmt: skip
    check_inputs(logits, targets)
    compiling = torch.compiler.is_compiling()

    if fused and logits.requires_grad and torch.is_grad_enabled() and logits.shape[0] > 0:
        if inplace:
            if logits.is_leaf:
                raise ValueError("inplace=True overwrites logits with their gradient, so logits must not be a leaf "
                                 "tensor")  # fmt: skip
            if may_overlap(logits):
                raise ValueError(f"inplace=True writes the gradient over logits, whose elements share memory "
                                 f"(strides {logits.stride()}, as in an expanded view); pass logits.contiguous() or "
                                 "inplace=False")  # fmt: skip
        if not compiling:
            return CrossEntropyFusedFunction.apply(
                logits,
                targets,
                ignore_index,
                label_smoothing,
                z_loss,
                reduction,
                inplace,
                None,
            )
        if inplace:
            raise ValueError("inplace=True works in eager mode only; under torch.compile use inplace=False")
        losses = _fused_op(logits, targets, None, ignore_index, label_smoothing, z_loss, reduction == "mean")[0]
        return losses if reduction == "none" else losses.sum()  # a mean's rows came scaled by 1 / n_valid

    if compiling:
        losses = _forward_op(logits, targets, ignore_index, label_smoothing, z_loss)[0]
    else:
        losses = CrossEntropyFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss, None)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row losses, (B, V) logits and (B,) int64 targets -> (B,) float32 (reduction='none')."""
    check_inputs(logits, targets)
    if torch.compiler.is_compiling():
        return _forward_op(logits, targets, -100, 0.0, 0.0)[0]
    check_target_range(targets, logits.shape[1], -100)
    return _forward(logits, targets, -100, 0.0, 0.0)[0]


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """dlogits for per-row losses: (B, V), (B,) int64, (B,) float32 upstream -> (B, V) logits' dtype.

    Needs no saved state: one kernel computes each row's logsumexp and then its gradient.
    """
    check_inputs(logits, targets)
    check_tensor("grad_output", grad_output)
    if not grad_output.is_floating_point():
        raise TypeError(f"grad_output must be a floating-point tensor, got dtype {grad_output.dtype}")
    if grad_output.shape != targets.shape:
        raise ValueError(f"grad_output must have shape {tuple(targets.shape)}, got {tuple(grad_output.shape)}")
    check_same_device(logits=logits, grad_output=grad_output)
    if torch.compiler.is_compiling():
        return _fused_op(logits, targets, grad_output.float(), -100, 0.0, 0.0, False)[1]
    check_target_range(targets, logits.shape[1], -100)
    return _fused(logits, targets, grad_output.float(), -100, 0.0, 0.0, False)[1]


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
