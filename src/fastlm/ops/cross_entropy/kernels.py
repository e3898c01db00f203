"""The cross-entropy kernels: the math, the cost model and the `@triton.jit` functions.

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

import triton
import triton.language as tl

from fastlm.ops.constants import LN2, LOG2E


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
def _row_loss(
    row_max,
    log_sum,
    shifted_sum,
    x_target,
    V,
    label_smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
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
def _row_grad(
    x,
    cols,
    target,
    row_max,
    log2_sum,
    V,
    label_smoothing,
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
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
    grad = grad_loss * _row_grad(
        x, cols, target, row_max, log2_sum, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
    )
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
        loss = _row_loss(row_max, log_sum, shifted_sum, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
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
            grad = scale * _row_grad(
                x.to(tl.float32), cols, target, row_max, log2_sum, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS
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
