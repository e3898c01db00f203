"""Fully fused linear + cross-entropy in Triton: logits tiles made, used and dropped in registers.

The loss of `fastlm.linear_cross_entropy` (``impl="fused"``) without any (N, V) or (C, V) buffer:

    logits tile  Z = hidden[rows] @ weight[cols].T (+ bias[cols])     (BLOCK_N, BLOCK_V), fp32 in registers
                 Z = c tanh(Z / c)                                    with softcap c
    per row      m = max_j z_j,  s = log sum_j exp(z_j - m),  lse = m + s
                 loss = s + (1 - eps)(m - z_t) - (eps / V) sum_j (z_j - m) + z_loss lse^2
    gradient     G = dloss/dZ = p (1 + 2 z_loss lse) - (1 - eps) onehot(t) - eps / V,  p = exp(z - m - s)
                 times the row's upstream gradient, and with softcap times 1 - tanh^2 (the chain rule)
                 grad_hidden = G @ weight,  grad_weight = G.T @ hidden,  grad_bias = sum over rows of G

Forward (`_linear_xent_forward_kernel`): program (token block, vocabulary split) walks its split's
tiles of BLOCK_V classes; each tile is a tl.dot loop over the width in BLOCK_D steps into an fp32
accumulator, and updates the rows' online max and sum of exponentials, the target's logit when the
target falls in the tile, and (label smoothing) the sum of (z - m). Splits give a short batch
enough programs; `_linear_xent_combine_kernel` merges each row's split partials into the loss (the
cross-entropy kernels' own `_row_loss`, so the semantics are `fastlm.cross_entropy`'s) and the
statistics (m, s) that the backward needs. Like the cross-entropy forward it saves (m, s), not lse:
with logits offset by 1e6, lse would carry fp32's 0.06 rounding into every exp(z - lse).

Backward (`_linear_xent_backward_kernel`): one program per (token block, vocabulary tile) recomputes
its logits tile from hidden and weight, forms G in registers (`_row_grad`, shared with the
cross-entropy kernels), rounds it to the compute dtype (as the chunked path's G is) and adds
G @ weight[cols] into grad_hidden[rows] and G.T @ hidden[rows] into grad_weight[cols], BLOCK_D
columns at a time, with fp32 atomic adds into zero-filled fp32 buffers (Cut Cross-Entropy's design,
Wijmans et al. 2024, arXiv:2411.09009). Programs are ordered so that GROUP_N token blocks sweep the
vocabulary together: the grad_hidden rows and grad_weight tiles they add into stay in L2.

Why atomics rather than a deterministic split into two kernels (one over token blocks owning
grad_hidden, one over vocabulary tiles owning grad_weight, each recomputing the logits):
- FLOPs: the split recomputes the logits twice, 8 N V d in its backward against 6 N V d here.
- Bytes: a program's own output (BLOCK_N x d fp32: 2 MiB at d = 4096) fits neither registers nor
  shared memory, so the split reads and writes it once per tile of the other dimension,
  8 N d V / BLOCK_V + 8 V d N / BLOCK_N bytes; with ~132 programs in flight each owning a different
  slab (~260 MiB) that traffic goes to HBM. At N = 8192, V = 128256, d = 4096 and 128 x 128 tiles it
  is 2 x 270 GB, about 80 ms per kernel at 3.35 TB/s, four times the ~17 ms its 4 N V d FLOPs take
  at an H100's 989 TFLOP/s. An atomic add sends 4 bytes (L2 does the read-modify-write), half of
  that, into lines the grouping keeps in L2. Whether L2's atomic throughput keeps pace with the
  tensor cores is for the GPU measurements to show; the tiles set the ratio (FLOPs per atomic
  byte: 6 BLOCK_N BLOCK_V / (4 (BLOCK_N + BLOCK_V)), 96 at 128 x 128).
- The price: fp32 sums in the order the programs finish, so the gradients vary run to run in their
  last fp32 bits (below the 16-bit rounding of a bf16 result). The forward has no atomics: the
  losses are reproducible.

Cost (N tokens, V classes, width d, s bytes per compute element, P vocabulary splits):
    FLOPs     forward 2 N V d; backward 6 N V d (logits again, grad_hidden, grad_weight): 8 N V d in
              all, against 6 N V d for the chunked implementation with reduction "mean" or "sum"
              (which computes the gradients in its forward) and 8 N V d with "none".
    operands  each tile reads BLOCK_N d + BLOCK_V d elements: (N d s) V / BLOCK_V + (V d s) N / BLOCK_N
              bytes per pass (the backward reads them twice: once for the logits, once for the
              products), served mostly by L2; from HBM at least (N + V) d s.
    atomics   4 N d V / BLOCK_V bytes into grad_hidden, 4 V d N / BLOCK_N into grad_weight, 4 V N / BLOCK_N
              into grad_bias; the fp32 buffers are zero-filled and cast to the inputs' dtypes once.
    memory    no logits: partials 16 N P bytes (forward only), statistics 8 N (forward to backward),
              fp32 accumulators N d and, for a 16-bit weight, V d (an fp32 weight's gradient is
              accumulated in place).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import wrap_triton

from fastlm.ops.common import cdiv, device_arch, dot_precision, multiprocessors, next_power_of_2, runs_triton
from fastlm.ops.cross_entropy import LN2, LOG2E, _row_grad, _row_loss
from fastlm.ops.cross_entropy import _reference_forward as xent_reference_forward
from fastlm.ops.cross_entropy import _reference_grad as xent_reference_grad
from fastlm.ops.launch import eager_kernel

if TYPE_CHECKING:
    from fastlm.ops.linear_cross_entropy import LossOptions

# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp alone (the interpreter has no libdevice): Cephes' tanhf, within 3 ulp.
    Near 0 an odd polynomial (1 - 2 / (exp(2x) + 1) would cancel there), beyond 0.625 that formula."""
    a = tl.abs(x)
    outer = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)  # exp overflows to inf for a > 44: tanh 1
    x2 = x * x
    inner = ((((-5.70498872745e-3 * x2 + 2.06390887954e-2) * x2 - 5.37397155531e-2) * x2 + 1.33314422036e-1) * x2
             - 3.33332819422e-1) * x2 * x + x  # fmt: skip
    return tl.where(a >= 0.625, tl.where(x < 0, -outer, outer), inner)


@triton.jit
def _logits_tile(
    hidden_ptr,  # (N, d) hidden states, compute dtype
    stride_hidden_row,
    stride_hidden_col,
    weight_ptr,  # (V, d) classifier weight, compute dtype
    stride_weight_row,
    stride_weight_col,
    bias_ptr,  # (V,) bias, compute dtype (read if HAS_BIAS)
    stride_bias,
    rows,  # (BLOCK_N,) int64 token indices; rows >= N are masked (read as zeros)
    cols,  # (BLOCK_V,) int64 class indices; cols >= V are masked
    N,
    V,
    D,  # width d
    softcap,  # c > 0 (read if HAS_SOFTCAP)
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,  # width step of the tl.dot loop
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # fp32 inputs: "ieee" or "tf32", as torch's matmul setting says
):
    """(logits, tanh): the (BLOCK_N, BLOCK_V) fp32 tile hidden[rows] @ weight[cols].T (+ bias), capped
    to c tanh(z / c) with HAS_SOFTCAP, and that tanh(z / c) (the backward's chain factor; the logits
    themselves otherwise). 2 BLOCK_N BLOCK_V d FLOPs; reads (BLOCK_N + BLOCK_V) d elements."""
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < N
    col_mask = cols < V
    hidden_ptrs = hidden_ptr + rows[:, None] * stride_hidden_row + offs_d[None, :] * stride_hidden_col
    # the weight tile read transposed, (BLOCK_D, BLOCK_V): the dot's right operand as it is needed
    weight_ptrs = weight_ptr + cols[None, :] * stride_weight_row + offs_d[:, None] * stride_weight_col
    logits = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        d_mask = start + offs_d < D
        h = tl.load(hidden_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(weight_ptrs, mask=d_mask[:, None] & col_mask[None, :], other=0.0)
        logits = tl.dot(h, w, logits, input_precision=DOT_PRECISION)
        hidden_ptrs += BLOCK_D * stride_hidden_col
        weight_ptrs += BLOCK_D * stride_weight_col
    if HAS_BIAS:
        logits += tl.load(bias_ptr + cols * stride_bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tanh = logits
    if HAS_SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)  # Inductor passes Python floats as fp64
        tanh = _tanh(logits / softcap)
        logits = softcap * tanh
    return logits, tanh


@triton.jit
def _linear_xent_forward_kernel(
    hidden_ptr,  # (N, d) hidden states, compute dtype
    stride_hidden_row,
    stride_hidden_col,
    weight_ptr,  # (V, d) classifier weight, compute dtype
    stride_weight_row,
    stride_weight_col,
    bias_ptr,  # (V,) bias, compute dtype (read if HAS_BIAS)
    stride_bias,
    targets_ptr,  # (N,) int32/int64 class indices
    stride_target,
    max_ptr,  # (SPLITS, N) fp32 out, contiguous: per (split k, row) the max m_k of the split's logits
    sum_exp_ptr,  # (SPLITS, N) fp32 out: sum of exp(z - m_k) over the split
    target_logit_ptr,  # (SPLITS, N) fp32 out: the target's logit, 0 where the target is not in the split
    shifted_sum_ptr,  # (SPLITS, N) fp32 out: sum of (z - m_k) over the split (written if HAS_SMOOTHING)
    N,
    V,
    D,
    SPLITS,  # vocabulary splits: split k covers classes [k cols_per_split, (k + 1) cols_per_split)
    cols_per_split,  # a multiple of BLOCK_V
    softcap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (token block, split), the splits of one token block adjacent in launch order so that
    the programs in flight share their hidden blocks in L2. 2 BLOCK_N cols_per_split d FLOPs; writes
    12-16 BLOCK_N bytes. Every split holds at least one class, so each m_k is finite."""
    pid = tl.program_id(0)
    split = (pid % SPLITS).to(tl.int64)
    rows = (pid // SPLITS).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    target = tl.load(targets_ptr + rows * stride_target, mask=row_mask, other=-1).to(tl.int64)
    first_col = split * cols_per_split
    last_col = tl.minimum(first_col + cols_per_split, V)
    row_max = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK_N,), tl.float32)  # sum of exp(z - row_max) over the split's columns so far
    x_target = tl.zeros((BLOCK_N,), tl.float32)
    shifted_sum = tl.zeros((BLOCK_N,), tl.float32)  # sum of (z - row_max) over them
    for start in range(first_col, last_col, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        logits, _ = _logits_tile(hidden_ptr, stride_hidden_row, stride_hidden_col, weight_ptr, stride_weight_row,
                                 stride_weight_col, bias_ptr, stride_bias, rows, cols, N, V, D, softcap, BLOCK_N,
                                 BLOCK_V, BLOCK_D, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION)  # fmt: skip
        logits = tl.where(col_mask[None, :], logits, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        # z - m formed before the scaling to base 2 (as the cross-entropy kernels do); exp2(-inf) = 0
        # rescales the empty sum before the first tile
        sum_exp = sum_exp * tl.exp2((row_max - new_max) * LOG2E) + tl.sum(
            tl.exp2((logits - new_max[:, None]) * LOG2E), axis=1
        )
        x_target += tl.sum(tl.where(cols[None, :] == target[:, None], logits, 0.0), axis=1)
        if HAS_SMOOTHING:  # the columns read before, re-centred on the new max (none before the first
            # tile, whose row_max -inf must not meet a 0 count)
            earlier = start - first_col
            previous_max = tl.where(earlier > 0, row_max, new_max)
            tile_sum = tl.sum(tl.where(col_mask[None, :], logits - new_max[:, None], 0.0), axis=1)
            shifted_sum += tile_sum - earlier * (new_max - previous_max)
        row_max = new_max
    offsets = split * N + rows
    tl.store(max_ptr + offsets, row_max, mask=row_mask)
    tl.store(sum_exp_ptr + offsets, sum_exp, mask=row_mask)
    tl.store(target_logit_ptr + offsets, x_target, mask=row_mask)
    if HAS_SMOOTHING:
        tl.store(shifted_sum_ptr + offsets, shifted_sum, mask=row_mask)


@triton.jit
def _linear_xent_combine_kernel(
    max_ptr,  # (SPLITS, N) fp32 partials from the forward kernel, as named there
    sum_exp_ptr,
    target_logit_ptr,
    shifted_sum_ptr,  # (read if HAS_SMOOTHING)
    targets_ptr,  # (N,) class indices
    stride_target,
    losses_ptr,  # (N,) fp32 out: 0 for ignored rows, NaN for targets outside [0, V)
    stats_ptr,  # (2, N) fp32 out: each row's max m (row 0) and s = log sum exp(z - m) (row 1)
    N,
    V,
    SPLITS,
    cols_per_split,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_ROWS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
):
    """One program per BLOCK_ROWS rows: m = max_k m_k, then sum_k exp(m_k - m) sum_exp_k. Reads
    12-16 SPLITS bytes per row (twice), writes 12."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < N
    row_max = tl.full((BLOCK_ROWS,), -float("inf"), tl.float32)
    offsets = rows  # of split k's entries: k N + rows, advanced in int64
    for _ in range(0, SPLITS):
        row_max = tl.maximum(row_max, tl.load(max_ptr + offsets, mask=row_mask, other=0.0))
        offsets += N
    sum_exp = tl.zeros((BLOCK_ROWS,), tl.float32)
    x_target = tl.zeros((BLOCK_ROWS,), tl.float32)
    shifted_sum = tl.zeros((BLOCK_ROWS,), tl.float32)
    offsets = rows
    for split in range(0, SPLITS):  # (masked rows read a sum of 1: no log of 0 below)
        split_max = tl.load(max_ptr + offsets, mask=row_mask, other=0.0)
        sum_exp += tl.load(sum_exp_ptr + offsets, mask=row_mask, other=1.0) * tl.exp2((split_max - row_max) * LOG2E)
        x_target += tl.load(target_logit_ptr + offsets, mask=row_mask, other=0.0)
        if HAS_SMOOTHING:  # the split's sum of (z - m_k), re-centred on m
            columns = tl.minimum(V - split * cols_per_split, cols_per_split)
            split_sum = tl.load(shifted_sum_ptr + offsets, mask=row_mask, other=0.0)
            shifted_sum += split_sum - columns * (row_max - split_max)
        offsets += N
    log_sum = tl.log2(sum_exp) * LN2
    loss = _row_loss(row_max, log_sum, shifted_sum, x_target, V, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
    target = tl.load(targets_ptr + rows * stride_target, mask=row_mask, other=0).to(tl.int64)
    ignored = target == ignore_index
    invalid = ~ignored & ((target < 0) | (target >= V))
    tl.store(losses_ptr + rows, tl.where(ignored, 0.0, tl.where(invalid, float("nan"), loss)), mask=row_mask)
    tl.store(stats_ptr + rows, row_max, mask=row_mask)
    tl.store(stats_ptr + N + rows, log_sum, mask=row_mask)


@triton.jit
def _linear_xent_backward_kernel(
    hidden_ptr,  # (N, d) hidden states, compute dtype
    stride_hidden_row,
    stride_hidden_col,
    weight_ptr,  # (V, d) classifier weight, compute dtype
    stride_weight_row,
    stride_weight_col,
    bias_ptr,  # (V,) bias, compute dtype (read if HAS_BIAS)
    stride_bias,
    targets_ptr,  # (N,) class indices
    stride_target,
    stats_ptr,  # (2, N) fp32 m and s from the forward
    grad_losses_ptr,  # (N,) fp32 upstream gradient of each row's loss (stride 0 when expanded)
    stride_grad_losses,
    grad_hidden_ptr,  # (N, d) fp32, contiguous, zero-filled: += G @ weight (if NEED_HIDDEN)
    grad_weight_ptr,  # (V, d) fp32, contiguous, zero-filled: += G.T @ hidden (if NEED_WEIGHT)
    grad_bias_ptr,  # (V,) fp32, zero-filled: += column sums of G (if NEED_BIAS)
    N,
    V,
    D,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,  # token blocks that sweep the vocabulary together
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    NEED_HIDDEN: tl.constexpr,
    NEED_WEIGHT: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (token block, vocabulary tile), grouped as in Triton's matmul tutorial: 6
    BLOCK_N BLOCK_V d FLOPs, (BLOCK_N + BLOCK_V) d fp32 atomic adds. A block whose rows are all
    ignored (padding, prompts) contributes nothing and returns at once."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(V, BLOCK_V)
    first_block = pid // (GROUP_N * col_tiles) * GROUP_N
    group_size = tl.minimum(tl.cdiv(N, BLOCK_N) - first_block, GROUP_N)
    block = first_block + pid % (GROUP_N * col_tiles) % group_size
    tile = pid % (GROUP_N * col_tiles) // group_size
    rows = block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tile.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V
    target = tl.load(targets_ptr + rows * stride_target, mask=row_mask, other=ignore_index).to(tl.int64)
    ignored = target == ignore_index  # rows past N too
    if tl.max((~ignored).to(tl.int32), axis=0) == 0:
        return
    logits, tanh = _logits_tile(hidden_ptr, stride_hidden_row, stride_hidden_col, weight_ptr, stride_weight_row,
                                stride_weight_col, bias_ptr, stride_bias, rows, cols, N, V, D, softcap, BLOCK_N,
                                BLOCK_V, BLOCK_D, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION)  # fmt: skip
    row_max = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    log2_sum = tl.load(stats_ptr + N + rows, mask=row_mask, other=0.0) * LOG2E
    scale = tl.load(grad_losses_ptr + rows * stride_grad_losses, mask=row_mask, other=0.0).to(tl.float32)
    grad = _row_grad(logits, cols[None, :], target[:, None], row_max[:, None], log2_sum[:, None], V, label_smoothing,
                     z_loss, HAS_SMOOTHING, HAS_Z_LOSS) * scale[:, None]  # fmt: skip
    if HAS_SOFTCAP:
        grad = grad * (1.0 - tanh * tanh)
    # ignored rows 0 even with an infinite scale (a mean over no valid row); bad targets NaN, as in
    # fastlm.cross_entropy; masked columns 0
    invalid = ~ignored & ((target < 0) | (target >= V))
    grad = tl.where(ignored[:, None] | ~col_mask[None, :], 0.0, tl.where(invalid[:, None], float("nan"), grad))
    if NEED_BIAS:
        tl.atomic_add(grad_bias_ptr + cols, tl.sum(grad, axis=0), mask=col_mask, sem="relaxed")
    grad = grad.to(hidden_ptr.dtype.element_ty)  # the products' operand, in the compute dtype
    offs_d = tl.arange(0, BLOCK_D)
    if NEED_HIDDEN:  # grad_hidden[rows] += G @ weight[cols], BLOCK_D columns at a time
        weight_ptrs = weight_ptr + cols[:, None] * stride_weight_row + offs_d[None, :] * stride_weight_col
        out_ptrs = grad_hidden_ptr + rows[:, None] * D + offs_d[None, :]
        for start in range(0, D, BLOCK_D):
            d_mask = start + offs_d < D
            w = tl.load(weight_ptrs, mask=col_mask[:, None] & d_mask[None, :], other=0.0)
            product = tl.dot(grad, w, input_precision=DOT_PRECISION)
            tl.atomic_add(out_ptrs, product, mask=row_mask[:, None] & d_mask[None, :], sem="relaxed")
            weight_ptrs += BLOCK_D * stride_weight_col
            out_ptrs += BLOCK_D
    if NEED_WEIGHT:  # grad_weight[cols] += G.T @ hidden[rows]
        grad_t = tl.trans(grad)
        hidden_ptrs = hidden_ptr + rows[:, None] * stride_hidden_row + offs_d[None, :] * stride_hidden_col
        out_ptrs = grad_weight_ptr + cols[:, None] * D + offs_d[None, :]
        for start in range(0, D, BLOCK_D):
            d_mask = start + offs_d < D
            h = tl.load(hidden_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            product = tl.dot(grad_t, h, input_precision=DOT_PRECISION)
            tl.atomic_add(out_ptrs, product, mask=col_mask[:, None] & d_mask[None, :], sem="relaxed")
            hidden_ptrs += BLOCK_D * stride_hidden_col
            out_ptrs += BLOCK_D


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearXentFusedConfig:
    """Tiles, warps and the forward's vocabulary split of the fused kernels (forward and backward
    share the tiles). Frozen, so it can key caches; make variants with `dataclasses.replace`."""

    block_n: int  # BLOCK_N: tokens per logits tile (a power of two >= 16, tl.dot's smallest operand)
    block_v: int  # BLOCK_V: classes per logits tile (a power of two >= 16)
    block_d: int  # BLOCK_D: width step of every tl.dot (a power of two >= 16)
    num_warps: int  # warps per program, both kernels
    num_stages: int  # software-pipelining depth of the width loops (shared-memory buffers)
    group_n: int  # backward: token blocks that sweep the vocabulary together (L2 reuse of the atomics)
    programs_per_sm: int  # forward on CUDA: vocabulary splits until the grid has this many programs per SM
    split_v: int | None = None  # forward: this many vocabulary splits instead (at most one per tile)

    def __post_init__(self):
        for name in ("block_n", "block_v", "block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if min(self.num_warps, self.num_stages, self.group_n, self.programs_per_sm) < 1 or self.split_v == 0:
            raise ValueError(f"warps, stages, group_n, programs_per_sm and split_v must be >= 1, got {self}")


# Guesses for sm90 (H100 / H200), not yet tuned: 128 x 128 logits tiles (64 KB of fp32 accumulator
# over 8 warps) and 64-wide width steps, 32 KB of bf16 operands per pipeline stage, 3 stages; fp32
# inputs take 32-wide steps for the same bytes.
_SM90 = LinearXentFusedConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3, group_n=8,
                              programs_per_sm=4)  # fmt: skip
# Other GPUs: the same tiles with 2 stages, which fit the ~100 KB of shared memory of smaller parts.
DEFAULT_CONFIG = replace(_SM90, num_stages=2)
# The interpreter (device_arch 0): small tiles and two splits, so that tests on tiny shapes cover
# several tiles, splits and partial blocks; more programs cost the interpreter little.
INTERPRETER_CONFIG = LinearXentFusedConfig(block_n=16, block_v=32, block_d=16, num_warps=4, num_stages=1,
                                           group_n=2, programs_per_sm=1, split_v=2)  # fmt: skip
_CONFIGS = {0: INTERPRETER_CONFIG, 90: _SM90}


@functools.cache
def linear_cross_entropy_fused_config(arch: int, dtype: torch.dtype, vocab: int, width: int) -> LinearXentFusedConfig:
    """The configuration for a ``vocab`` x ``width`` weight in ``dtype`` on GPU architecture ``arch``
    (`device_arch`: 90 for H100 / H200, 0 for the interpreter): the table's entry, its vocabulary
    and width steps no wider than the operands (rounded up to a power of two, at least 16), fp32
    with half-width steps (the same bytes per stage). Cached."""
    config = _CONFIGS.get(arch, DEFAULT_CONFIG)
    block_d = config.block_d // 2 if dtype == torch.float32 and config.block_d > 16 else config.block_d
    return replace(
        config,
        block_v=min(config.block_v, max(16, next_power_of_2(vocab))),
        block_d=min(block_d, max(16, next_power_of_2(width))),
    )


def _picked_config(hidden: torch.Tensor, vocab: int) -> LinearXentFusedConfig:
    width = hidden.shape[1]
    # a SymInt size (a trace with dynamic shapes) cannot key the cache: a trace picks once
    cached = type(vocab) is int and type(width) is int
    pick = linear_cross_entropy_fused_config if cached else linear_cross_entropy_fused_config.__wrapped__
    return pick(device_arch(hidden.device), hidden.dtype, vocab, width)


def _vocabulary_splits(config: LinearXentFusedConfig, row_blocks: int, col_tiles: int, device) -> tuple[int, int]:
    """(splits, classes per split) of the forward grid: ``config.split_v``, or on CUDA enough splits
    for ``programs_per_sm`` programs per SM, or 1; then no more than one per tile, and none empty."""
    wanted = config.split_v
    if wanted is None and device.type == "cuda":
        wanted = cdiv(config.programs_per_sm * multiprocessors(device.index), row_blocks)
    elif wanted is None:
        wanted = 1
    tiles_per_split = cdiv(col_tiles, max(1, min(wanted, col_tiles)))
    return cdiv(col_tiles, tiles_per_split), tiles_per_split * config.block_v


COMBINE_ROWS = 1024  # rows per program of the combine kernel (it reads a few floats per row and split)


# ----------------------------------------------------------------------------------------------
# Launchers: shared by the eager autograd.Function and the triton_ops (``traced``); the plain-PyTorch
# path where Triton cannot run (a CPU without the interpreter, a CPU trace, fake tensors)
# ----------------------------------------------------------------------------------------------


def _compute_operands(hidden, weight, bias):
    """weight and bias in hidden's (the compute) dtype: under autocast a V x d copy of an fp32
    master weight, as F.linear under autocast makes; no copy otherwise."""
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


def _fused_forward(hidden, weight, bias, targets, options: LossOptions, config=None, traced=False):
    """(losses (N,) fp32, stats (2, N) fp32: each row's max m and s = log sum exp(z - m))."""
    ignore_index, label_smoothing, z_loss, softcap = options
    weight, bias = _compute_operands(hidden, weight, bias)
    if not runs_triton(hidden):
        logits, _ = _reference_logits(hidden, weight, bias, softcap)
        return xent_reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    rows, width = hidden.shape
    vocab = weight.shape[0]
    losses = torch.empty(rows, device=hidden.device, dtype=torch.float32)
    stats = torch.empty((2, rows), device=hidden.device, dtype=torch.float32)
    if rows == 0:
        return losses, stats
    config = _picked_config(hidden, vocab) if config is None else config
    row_blocks = cdiv(rows, config.block_n)
    splits, cols_per_split = _vocabulary_splits(config, row_blocks, cdiv(vocab, config.block_v), hidden.device)
    smoothing = label_smoothing > 0
    # (max, sum_exp, target_logit[, shifted_sum]) per split and row: the kernels' partials
    partials = torch.empty((4 if smoothing else 3, splits, rows), device=hidden.device, dtype=torch.float32)
    shifted_sums = partials[3] if smoothing else partials[0]  # not written without label smoothing
    kernel = wrap_triton(_linear_xent_forward_kernel) if traced else eager_kernel(_linear_xent_forward_kernel)
    kernel[(splits * row_blocks,)](
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        hidden if bias is None else bias, 0 if bias is None else bias.stride(0), targets, targets.stride(0),
        partials[0], partials[1], partials[2], shifted_sums, rows, vocab, width, splits, cols_per_split,
        1.0 if softcap is None else softcap,
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d, HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=smoothing, DOT_PRECISION=dot_precision(hidden.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    kernel = wrap_triton(_linear_xent_combine_kernel) if traced else eager_kernel(_linear_xent_combine_kernel)
    kernel[(cdiv(rows, COMBINE_ROWS),)](
        partials[0], partials[1], partials[2], shifted_sums, targets, targets.stride(0), losses, stats, rows, vocab,
        splits, cols_per_split, ignore_index, label_smoothing, z_loss,
        BLOCK_ROWS=COMBINE_ROWS, HAS_SMOOTHING=smoothing, HAS_Z_LOSS=z_loss > 0, num_warps=4,
    )  # fmt: skip
    return losses, stats


def _fused_backward(hidden, weight, bias, targets, stats, grad_losses, needs, options: LossOptions, config=None,
                    traced=False):  # fmt: skip
    """(grad_hidden, grad_weight, grad_bias) for the upstream ``grad_losses`` (N,), each None where
    ``needs`` (hidden, weight, bias) says it is not wanted; in hidden's, weight's and bias's dtypes
    (an fp32 weight's gradient is the fp32 accumulator itself)."""
    need_hidden, need_weight, need_bias = needs
    compute_weight, compute_bias = _compute_operands(hidden, weight, bias)
    if runs_triton(hidden):
        grads = _kernel_gradients(hidden, compute_weight, compute_bias, targets, stats, grad_losses, needs, options,
                                  config, traced)  # fmt: skip
    else:
        grads = _reference_gradients(hidden, compute_weight, compute_bias, targets, grad_losses, options)
    grad_hidden, grad_weight, grad_bias = grads
    return (
        grad_hidden.to(hidden.dtype) if need_hidden else None,
        grad_weight.to(weight.dtype) if need_weight else None,
        grad_bias.to(bias.dtype) if need_bias else None,
    )


def _kernel_gradients(hidden, weight, bias, targets, stats, grad_losses, needs, options: LossOptions, config,
                      traced):  # fmt: skip
    """The fp32 accumulators (grad_hidden, grad_weight, grad_bias), None where not needed, for
    weight and bias in hidden's dtype: zero-filled, then one backward launch adds into them."""
    ignore_index, label_smoothing, z_loss, softcap = options
    need_hidden, need_weight, need_bias = needs
    rows, width = hidden.shape
    vocab = weight.shape[0]
    fp32 = dict(device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.zeros((rows, width), **fp32) if need_hidden else None
    grad_weight = torch.zeros((vocab, width), **fp32) if need_weight else None
    grad_bias = torch.zeros(vocab, **fp32) if need_bias else None
    if rows == 0 or not any(needs):
        return grad_hidden, grad_weight, grad_bias
    config = _picked_config(hidden, vocab) if config is None else config
    kernel = wrap_triton(_linear_xent_backward_kernel) if traced else eager_kernel(_linear_xent_backward_kernel)
    unused = stats  # any fp32 tensor stands for an output not computed (its kernel code is compiled out)
    kernel[(cdiv(rows, config.block_n) * cdiv(vocab, config.block_v),)](
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        hidden if bias is None else bias, 0 if bias is None else bias.stride(0), targets, targets.stride(0), stats,
        grad_losses, grad_losses.stride(0), unused if grad_hidden is None else grad_hidden,
        unused if grad_weight is None else grad_weight, unused if grad_bias is None else grad_bias,
        rows, vocab, width, ignore_index, label_smoothing, z_loss, 1.0 if softcap is None else softcap,
        BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d, GROUP_N=config.group_n,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0, NEED_HIDDEN=need_hidden, NEED_WEIGHT=need_weight, NEED_BIAS=need_bias,
        DOT_PRECISION=dot_precision(hidden.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return grad_hidden, grad_weight, grad_bias


# The plain-PyTorch path: the kernels' arithmetic (fp32 logits from compute-dtype operands, G rounded
# to the compute dtype before the products) on the whole (N, V) logits at once; a CPU is for tests.


def _reference_logits(hidden, weight, bias, softcap):
    """((N, V) fp32 logits, capped with softcap; tanh(z / c), None without softcap)."""
    with torch.autocast(hidden.device.type, enabled=False):  # fp32 products of the compute-dtype values
        logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return softcap * tanh, tanh


def _reference_gradients(hidden, weight, bias, targets, grad_losses, options: LossOptions):
    """(grad_hidden, grad_weight, grad_bias) in fp32, each computed."""
    ignore_index, label_smoothing, z_loss, softcap = options
    logits, tanh = _reference_logits(hidden, weight, bias, softcap)
    grad = xent_reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss)
    if softcap is not None:
        grad = grad * (1 - tanh * tanh)
    grad = grad.to(hidden.dtype).float()
    with torch.autocast(hidden.device.type, enabled=False):
        return grad @ weight.float(), grad.t() @ hidden.float(), grad.sum(0)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


def _needs(ctx) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) want a gradient: inputs 0, 1 and 3 of every linear +
    cross-entropy op and autograd.Function (hidden, weight, targets, bias, ...)."""
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]


def _where_needed(grads, needs) -> tuple:
    """An op's gradients, None where not needed (the op returned an empty tensor there)."""
    return tuple(grad if need else None for grad, need in zip(grads, needs, strict=True))


@torch.library.triton_op("fastlm::linear_cross_entropy_fused_forward", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses (N,) fp32, stats (2, N) fp32); the backward recomputes the logits tiles."""
    return _fused_forward(hidden, weight, bias, targets, (ignore_index, label_smoothing, z_loss, softcap), traced=True)


@torch.library.triton_op("fastlm::linear_cross_entropy_fused_backward", mutates_args=())
def _backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    grad_losses: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_hidden, grad_weight, grad_bias), each empty where not needed."""
    options = (ignore_index, label_smoothing, z_loss, softcap)
    grads = _fused_backward(hidden, weight, bias, targets, stats, grad_losses, (need_hidden, need_weight, need_bias),
                            options, traced=True)  # fmt: skip
    return tuple(hidden.new_empty(0) if grad is None else grad for grad in grads)


def _forward_setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, *options = inputs
    _, stats = output
    ctx.save_for_backward(hidden, weight, targets, bias, stats)
    ctx.options = options
    ctx.mark_non_differentiable(stats)


def _forward_op_backward(ctx, grad_losses, _grad_stats):
    hidden, weight, targets, bias, stats = ctx.saved_tensors
    needs = _needs(ctx)
    grads = _backward_op(hidden, weight, targets, bias, stats, grad_losses, *needs, *ctx.options)
    grad_hidden, grad_weight, grad_bias = _where_needed(grads, needs)
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None


torch.library.register_autograd(_forward_op, _forward_op_backward, setup_context=_forward_setup_context)


class LinearCrossEntropyKernels(torch.autograd.Function):
    """The fused kernels, eager: per-row losses (N,) fp32; backward recomputes the logits tiles.
    ``LinearCrossEntropyKernels.apply(hidden, weight, targets, bias, options, config)`` on inputs
    `linear_cross_entropy` checked (weight and bias in hidden's dtype or fp32 under autocast),
    ``options`` a LossOptions, ``config`` a LinearXentFusedConfig or None (picked for hidden)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, options, config):
        config = _picked_config(hidden, weight.shape[0]) if config is None else config  # once for both directions
        losses, stats = _fused_forward(hidden, weight, bias, targets, options, config)
        ctx.save_for_backward(hidden, weight, targets, bias, stats)
        ctx.options, ctx.config = options, config
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets, bias, stats = ctx.saved_tensors
        grad_hidden, grad_weight, grad_bias = _fused_backward(hidden, weight, bias, targets, stats, grad_losses,
                                                              _needs(ctx), ctx.options, ctx.config)  # fmt: skip
        return grad_hidden, grad_weight, None, grad_bias, None, None
