"""LayerNorm and RMSNorm over the last dimension: fused Triton forward and backward.

    layer_norm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
    rms_norm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)

Input (..., D) of any rank is viewed as rows (M, D). One kernel family serves both norms
(`RMS` drops the centering). Statistics (mean, rstd: (M,) fp32) are saved for the backward:

    x_hat = (x - mean) * rstd,  g = dy * w
    dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g))       (RMSNorm: without the mean(g) term)
    dw = sum_rows dy * x_hat,   db = sum_rows dy

LayerNorm centers each row on its first element x0 = x[row, 0] before anything is summed, and
saves mean - x0 rather than the mean: x - x0 is exact where a row's values share a large offset
(activations around 1e4 with a spread of 1), so the mean and x - mean keep fp32's relative
precision, where x - fl(mean) would carry the mean's rounding (0.06 at an offset of 1e6) into every
x_hat. Every kernel forms x_hat as ((x - x0) - (mean - x0)) * rstd.

Both row reductions of dx come from one pass over the row. dw and db are reduced without float
atomics, in a fixed order (the same bits every run): a few programs per SM each take every
programs-th tile of rows and write their partial sums to their own row of a (programs, D) fp32
buffer. Rows up to `fused_sum_max_d` wide sum those inside the same launch: the last program of each
group of `fused_sum_group` to finish sums its group's rows, and the last group to finish sums the
group sums into dw / db in the parameters' dtype ("last": a ticket from an int32 counter,
`_last_to_arrive`; `_counters` says where the counters live and what that allows). One program
reading ~2 sqrt(programs) partial rows is slower than a grid-wide pass for wide rows, so wider rows
sum them in a second small kernel, column block by column block. dw / db are skipped when the
weight / bias do not require grad.

Rows up to `forward_block_max` / `backward_block_max` (16-bit RMSNorm: `rms_16bit_backward_block_max`)
wide are held in registers (one read of x in the forward, one of x and dy in the backward), several
narrow rows to a (BLOCK_M, BLOCK_D) tile; wider rows (up to 65536 and beyond) loop over column
chunks, re-reading the row once per pass (forward: statistics, then output; backward: sums, then
dx), and their dw / db come from a second kernel that streams x and dy again by column blocks (4MD
more bytes read in bf16, none read-modify-written), whose last row group to finish a column block
sums that block's partials (in parallel over the column blocks).

Bytes (bf16 x, fp32 statistics, ignoring the small weight): forward 2MD read + 2MD written;
backward 4MD read (x, dy) + 2MD written (dx).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from fastlm.ops.common import (
    RowTiles,
    as_rows,
    cdiv,
    check_dtype,
    check_number,
    check_optional_tensor,
    check_same_device,
    check_tensor,
    device_arch,
    multiprocessors,
    row_tiles,
    runs_triton,
)
from fastlm.ops.launch import eager_kernel

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _norm_forward_kernel(
    X,  # (M, D) input rows, row stride stride_x
    W,  # (D,) weight, or a dummy when HAS_WEIGHT is False
    B,  # (D,) bias, or a dummy when HAS_BIAS is False
    Y,  # (M, D) output, contiguous
    MEAN,  # (M,) fp32 mean - x[row, 0] (written for LayerNorm only)
    RSTD,  # (M,) fp32 1 / sqrt(var + eps)
    stride_x,
    M,
    D,
    eps,
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (a (BLOCK_M, BLOCK_D) tile; 1 when looping)
    BLOCK_D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_D >= D: the rows stay in registers
):
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64: keep the math in fp32
    cols = tl.arange(0, BLOCK_D)
    if SINGLE_PASS:
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        col_mask = cols < D
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if RMS:
            centered = x
        else:  # about x0 = x[row, 0] (module docstring); MEAN holds mean - x0
            x0 = tl.load(X + rows * stride_x, mask=row_mask, other=0.0).to(tl.float32)
            shifted = tl.where(mask, x - x0[:, None], 0.0)
            mean = tl.sum(shifted, axis=1) / D
            centered = tl.where(mask, shifted - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=row_mask)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / D + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row, y_row = X + row * stride_x, Y + row * D
        x0 = 0.0  # LayerNorm: x[row, 0], the row's center (module docstring)
        mean = 0.0  # LayerNorm: mean - x0
        if not RMS:
            x0 = tl.load(x_row).to(tl.float32)
            total = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for start in range(0, D, BLOCK_D):
                mask = start + cols < D
                x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                total += tl.where(mask, x - x0, 0.0)
            mean = tl.sum(total, axis=0) / D
            tl.store(MEAN + row, mean)
        squares = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):  # second pass: variance around the exact mean
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            centered = tl.where(mask, x - x0 - mean, 0.0)
            squares += centered * centered
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / D + eps)
        tl.store(RSTD + row, rstd)
        for start in range(0, D, BLOCK_D):
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - x0 - mean) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(B + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_chunk(X, DY, rows, row_mask, cols, D, stride_x, stride_dy):
    """x and dy of rows x cols as fp32 (0 outside the matrix), the chunk's mask and column mask."""
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, dy, mask, col_mask


@triton.jit
def _centre(X, MEAN, rows, row_mask, stride_x, RMS: tl.constexpr):
    """(x0, mean - x0) of each row as (rows, 1) fp32, x - x0 - (mean - x0) being its centered values
    (module docstring); (0.0, 0.0) for RMSNorm. x0 is one more load per row, from the row the
    caller reads anyway."""
    x0 = 0.0 if RMS else tl.load(X + rows * stride_x, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    mean = 0.0 if RMS else tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
    return x0, mean


@triton.jit
def _last_to_arrive(COUNTER, arrivals):
    """Counts this program in at COUNTER (int32, 0 before the first of ``arrivals`` programs counts
    in). True for the last one, which then sees every store the others made before counting in,
    and puts the counter back to 0 for the next launch.

    Memory order: the barrier puts the stores of all of this program's threads before the one
    thread's atomic; its release publishes them, and the last program's acquire (a chain of RMWs on
    one address) makes them visible to it. Readers still load them with .cg (from L2)."""
    tl.debug_barrier()
    last = tl.atomic_add(COUNTER, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.store(COUNTER, 0)  # every other program has counted in: nothing touches it again this launch
    return last


@triton.jit
def _column_sums(PARTIAL, first, step, count, D, cols, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_D,) fp32: at columns ``cols`` (< D), the sum of the ``count`` rows first, first + step,
    ... of PARTIAL ((rows, D) fp32), in a fixed order (the same bits whichever program adds them).
    Other programs wrote these rows: they are read from L2 (.cg), never from a stale line of L1."""
    total = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for start in range(0, count, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < count)[:, None] & (cols < D)[None, :]
        offsets = (first + rows.to(tl.int64) * step)[:, None] * D + cols[None, :]
        total += tl.load(PARTIAL + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return tl.sum(total, axis=0)


@triton.jit
def _sum_rows(PARTIAL, OUT, first, step, count, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[:D] = the fixed-order sum of rows first, first + step, ... (count of them) of PARTIAL, in
    OUT's dtype; OUT may be row ``first`` of PARTIAL (each column block is read before it is written)."""
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        total = _column_sums(PARTIAL, first, step, count, D, cols, BLOCK_R, BLOCK_D)
        tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=cols < D)


@triton.jit
def _norm_backward_kernel(
    X,  # (M, D) input rows of the forward, row stride stride_x
    W,  # (D,) weight, or a dummy when HAS_WEIGHT is False
    DY,  # (M, D) upstream gradient, row stride stride_dy
    DX,  # (M, D) input gradient (output), contiguous
    MEAN,  # (M,) fp32 mean - x[row, 0] (LayerNorm only)
    RSTD,  # (M,) fp32
    PARTIAL,  # (WEIGHT_GRAD + BIAS_GRAD, programs, D) fp32, single pass: per program, sums of dy * x_hat, of dy
    DW,  # (D,) dw in the weight's dtype (output), or a dummy when WEIGHT_GRAD is False
    DB,  # (D,) db (output), or a dummy when BIAS_GRAD is False
    COUNTERS,  # FUSED_SUM: (>= cdiv(programs, SUM_GROUP) + 1,) int32, all 0; left at 0
    stride_x,
    stride_dy,
    M,
    D,
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile, or per (BLOCK_M, BLOCK_D) chunk when looping
    BLOCK_D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    FUSED_SUM: tl.constexpr,  # sum the partial rows into DW / DB here (else _sum_partials_kernel does)
    SUM_GROUP: tl.constexpr,  # partial rows summed by the last program of each group (power of two)
    SUM_BLOCK_D: tl.constexpr,  # columns per step of those sums
):
    # Program p takes the row tiles p, p + programs, p + 2 programs, ...
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    if SINGLE_PASS:
        col_mask = cols < D
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else 1.0
        # (BLOCK_M, BLOCK_D) accumulators, reduced over rows once at the end
        dw = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        db = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for tile in range(pid, tl.cdiv(M, BLOCK_M), programs):
            rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            x, dy, mask, _ = _load_chunk(X, DY, rows, row_mask, cols, D, stride_x, stride_dy)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
            x0, mean = _centre(X, MEAN, rows, row_mask, stride_x, RMS)
            x_hat = tl.where(mask, (x - x0 - mean) * rstd, 0.0)
            g = dy * w
            dx = g - x_hat * (tl.sum(g * x_hat, axis=1) / D)[:, None]
            if not RMS:
                dx = dx - (tl.sum(g, axis=1) / D)[:, None]
            tl.store(DX + rows[:, None] * D + cols[None, :], (dx * rstd).to(DX.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw += dy * x_hat
            if BIAS_GRAD:
                db += dy
        DB_PARTIAL = PARTIAL + programs * D if WEIGHT_GRAD else PARTIAL
        if WEIGHT_GRAD:
            tl.store(PARTIAL + pid * D + cols, tl.sum(dw, axis=0), mask=col_mask)
        if BIAS_GRAD:
            tl.store(DB_PARTIAL + pid * D + cols, tl.sum(db, axis=0), mask=col_mask)
        if FUSED_SUM and (WEIGHT_GRAD or BIAS_GRAD):
            # Two levels, so that no one program reads all (programs, D) partials: the last program
            # of each group sums the group's rows into the group's first row, the last group to
            # finish sums those first rows into dw / db.
            group = pid // SUM_GROUP
            first = group * SUM_GROUP
            members = tl.minimum(SUM_GROUP, programs - first)
            if _last_to_arrive(COUNTERS + group, members):
                if WEIGHT_GRAD:
                    _sum_rows(PARTIAL, PARTIAL + first * D, first, 1, members, D, SUM_GROUP, SUM_BLOCK_D)
                if BIAS_GRAD:
                    _sum_rows(DB_PARTIAL, DB_PARTIAL + first * D, first, 1, members, D, SUM_GROUP, SUM_BLOCK_D)
                groups = tl.cdiv(programs, SUM_GROUP)
                if _last_to_arrive(COUNTERS + groups, groups):
                    if WEIGHT_GRAD:
                        _sum_rows(PARTIAL, DW, 0, SUM_GROUP, groups, D, SUM_GROUP, SUM_BLOCK_D)
                    if BIAS_GRAD:
                        _sum_rows(DB_PARTIAL, DB, 0, SUM_GROUP, groups, D, SUM_GROUP, SUM_BLOCK_D)
    else:
        # dx only: dw / db of wide rows come from _norm_param_grad_kernel
        for tile in range(pid, tl.cdiv(M, BLOCK_M), programs):
            rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
            x0, mean = _centre(X, MEAN, rows, row_mask, stride_x, RMS)
            gx = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            gs = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for start in range(0, D, BLOCK_D):  # pass 1: both row reductions
                x, dy, mask, col_mask = _load_chunk(X, DY, rows, row_mask, start + cols, D, stride_x, stride_dy)
                w = tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else 1.0
                g = dy * w
                gx += g * tl.where(mask, (x - x0 - mean) * rstd, 0.0)
                gs += g
            mean_gx = (tl.sum(gx, axis=1) / D)[:, None]
            mean_g = 0.0 if RMS else (tl.sum(gs, axis=1) / D)[:, None]
            # pass 2 re-reads the rows, from L2 (they were read a moment ago, and few are in flight)
            for start in range(0, D, BLOCK_D):  # pass 2: dx
                x, dy, mask, col_mask = _load_chunk(X, DY, rows, row_mask, start + cols, D, stride_x, stride_dy)
                w = tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else 1.0
                x_hat = tl.where(mask, (x - x0 - mean) * rstd, 0.0)
                dx = (dy * w - x_hat * mean_gx - mean_g) * rstd
                tl.store(DX + rows[:, None] * D + (start + cols)[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _norm_param_grad_kernel(
    X,  # (M, D) input rows of the forward
    DY,  # (M, D) upstream gradient
    MEAN,  # (M,) fp32 mean - x[row, 0] (LayerNorm only)
    RSTD,  # (M,) fp32
    PARTIAL,  # (WEIGHT_GRAD + BIAS_GRAD, groups, D) fp32: per row group, its sums of dy * x_hat, then of dy
    DW,  # (D,) dw in the weight's dtype (output), or a dummy when WEIGHT_GRAD is False
    DB,  # (D,) db (output), or a dummy when BIAS_GRAD is False
    COUNTERS,  # (>= cdiv(D, BLOCK_D),) int32, all 0: one per column block; left at 0
    stride_x,
    stride_dy,
    M,
    D,
    ROWS_PER_GROUP,
    RMS: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUM_GROUP: tl.constexpr,  # partial rows per step of the final sum
):
    """dw / db of rows too wide for the single-pass backward. Program (c, g) sums column block c
    over row group g in (BLOCK_M, BLOCK_D) registers and writes one partial row: x and dy are read
    a second time, but streamed, where a read-modify-write of a (programs, D) partial per row chunk
    in the dx kernel made the L2 overflow. The last row group to finish column block c sums its
    column of partials into dw / db. Grid (cdiv(D, BLOCK_D), groups)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    first = group.to(tl.int64) * ROWS_PER_GROUP
    end = tl.minimum(first + ROWS_PER_GROUP, M)
    dw = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        x, dy, mask, _ = _load_chunk(X, DY, rows, row_mask, cols, D, stride_x, stride_dy)
        if WEIGHT_GRAD:
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
            x0, mean = _centre(X, MEAN, rows, row_mask, stride_x, RMS)
            dw += dy * tl.where(mask, (x - x0 - mean) * rstd, 0.0)
        if BIAS_GRAD:
            db += dy
    col_mask = cols < D
    DB_PARTIAL = PARTIAL + groups * D if WEIGHT_GRAD else PARTIAL
    if WEIGHT_GRAD:
        tl.store(PARTIAL + group * D + cols, tl.sum(dw, axis=0), mask=col_mask)
    if BIAS_GRAD:
        tl.store(DB_PARTIAL + group * D + cols, tl.sum(db, axis=0), mask=col_mask)
    if _last_to_arrive(COUNTERS + tl.program_id(0), groups):
        if WEIGHT_GRAD:
            dw_sum = _column_sums(PARTIAL, 0, 1, groups, D, cols, SUM_GROUP, BLOCK_D)
            tl.store(DW + cols, dw_sum.to(DW.dtype.element_ty), mask=col_mask)
        if BIAS_GRAD:
            db_sum = _column_sums(DB_PARTIAL, 0, 1, groups, D, cols, SUM_GROUP, BLOCK_D)
            tl.store(DB + cols, db_sum.to(DB.dtype.element_ty), mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    PARTIAL,  # (WEIGHT_GRAD + BIAS_GRAD, P, D) fp32: one row per backward program, dw's then db's
    DW,  # (D,) dw in the weight's dtype, or a dummy when WEIGHT_GRAD is False
    DB,  # (D,) db in the bias's dtype, or a dummy
    P,
    D,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dw and db of the single-pass backward when its rows are wider than fused_sum_max_d: the column
    sums of the partial rows, in a fixed order, cast once. Grid cdiv(D, BLOCK_D)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    if WEIGHT_GRAD:
        tl.store(DW + cols, _column_sums(PARTIAL, 0, 1, P, D, cols, BLOCK_P, BLOCK_D).to(DW.dtype.element_ty),
                 mask=col_mask)  # fmt: skip
    if BIAS_GRAD:
        DB_PARTIAL = PARTIAL + P * D if WEIGHT_GRAD else PARTIAL
        tl.store(DB + cols, _column_sums(DB_PARTIAL, 0, 1, P, D, cols, BLOCK_P, BLOCK_D).to(DB.dtype.element_ty),
                 mask=col_mask)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormConfig:
    """Launch settings of the norm kernels for one GPU architecture; the defaults are the H100's,
    from benchmarks/tune_norms.py (best geometric mean over the `fastlm bench norms` shapes, bf16
    and fp32; benchmarks/results/norms_tuning_h100.jsonl)."""

    # Elements per (BLOCK_M, BLOCK_D) forward tile and per warp: narrow rows are stacked into tiles
    # so that every program moves enough bytes.
    forward_tile: int = 2048
    forward_per_warp: int = 512
    # The same for the single-pass backward, whose programs each stride over many tiles.
    backward_tile: int = 4096
    backward_per_warp: int = 512
    # Single-pass backward programs per SM: each writes a (D,) partial row of dw / db.
    backward_programs_per_sm: int = 2
    # Widest rows held in registers (one read of each input); wider rows loop over chunks this wide.
    forward_block_max: int = 16384
    # The backward keeps more per element (x, dy, the dw / db accumulators), so its limit is lower.
    backward_block_max: int = 8192
    # RMSNorm of 16-bit rows keeps rows this wide in registers in the backward too: x, dy and its one
    # dw accumulator, 32 values each per thread at 16 warps, faster than looping at 4096 x 16384 bf16;
    # LayerNorm (a db accumulator and the mean more) and fp32 rows spill at that width.
    rms_16bit_backward_block_max: int = 16384
    # Rows per chunk of the looped backward (dx only, a power of two); its pass 2 re-reads each chunk
    # from L2.
    looped_backward_rows: int = 1
    # Looped-backward programs per SM: as many as keep this many bytes of x and dy chunks in flight,
    # so 2 in bf16 and 1 in fp32 (a second fp32 program was slower for RMSNorm, a single bf16 one too;
    # --sweep bwd,param 16384).
    looped_bytes_per_sm: int = 64 * 1024
    # dw / db of looped rows (_norm_param_grad_kernel): (block_m, block_d) tiles over row groups, so
    # cdiv(D, 512) x 16 programs and a (16, D) partial per gradient.
    param_grad_block_m: int = 8
    param_grad_block_d: int = 512
    param_grad_warps: int = 4
    param_grad_groups: int = 16
    # Widest single-pass rows whose dw / db are summed inside the backward's launch, saving a launch:
    # wider, the one program that adds up the group sums reads too much alone and the separate sum
    # kernel is faster (docs/notes/host_path.md; --sweep sum times both at every width).
    fused_sum_max_d: int = 1024
    # Those sums: partial rows per group (a power of two, about sqrt(programs) so that both levels
    # read about as much; also the rows per step of the wide rows' sums) and columns per step. Not
    # swept yet.
    fused_sum_group: int = 16
    fused_sum_block_d: int = 256
    # The separate sum (_sum_partials_kernel): (sum_block_p, sum_block_d) fp32 tiles, one program per
    # sum_block_d columns. Narrow column blocks give enough programs for 1024-wide rows (64 against
    # 8 with 128 columns; --sweep sum).
    sum_block_p: int = 256
    sum_block_d: int = 16


# Measured settings per architecture (device_arch); every other GPU, and the interpreter (0), takes
# the defaults.
_CONFIGS = {90: NormConfig()}
_INTERPRETER_PROGRAMS = 4  # backward programs on a CPU: enough for strided tiles and several partial rows


@functools.cache
def norm_config(arch: int) -> NormConfig:
    """The launch settings for GPUs of compute capability ``arch`` (`fastlm.ops.common.device_arch`).
    They depend on no dtype or shape: `forward_tiles` / `backward_tiles` apply them to a shape."""
    return _CONFIGS.get(arch, NormConfig())


def forward_tiles(config: NormConfig, d: int) -> RowTiles:
    return row_tiles(d, config.forward_tile, config.forward_per_warp, config.forward_block_max)


def backward_tiles(config: NormConfig, d: int, m: int, element_size: int, rms: bool, sms: int) -> tuple[RowTiles, int]:
    """(tiles, programs) of the backward on a GPU of ``sms`` SMs (0: the interpreter). Rows up to
    backward_block_max wide (rms_16bit_backward_block_max for 16-bit RMSNorm): stacked tiles, one
    pass. Wider: chunks of up to looped_backward_rows rows x (backward_block_max / that) columns,
    fewer rows per chunk when there are too few rows to give every program a chunk of that many."""
    block_max = config.rms_16bit_backward_block_max if rms and element_size == 2 else config.backward_block_max
    tiles = row_tiles(d, config.backward_tile, config.backward_per_warp, block_max)
    if tiles.single_pass:
        return tiles, min(cdiv(m, tiles.block_m), _programs_per_gpu(config, tiles, element_size, sms))
    rows = config.looped_backward_rows  # a power of two (tl.arange)
    while rows > 1:
        chunks = RowTiles(rows, config.backward_block_max // rows, False, tiles.num_warps)
        capacity = _programs_per_gpu(config, chunks, element_size, sms)
        if rows <= m and cdiv(m, rows) >= min(m, capacity):
            return chunks, min(cdiv(m, rows), capacity)
        rows //= 2
    chunks = RowTiles(1, config.backward_block_max, False, tiles.num_warps)
    return chunks, min(m, _programs_per_gpu(config, chunks, element_size, sms))


def _programs_per_gpu(config: NormConfig, tiles: RowTiles, element_size: int, sms: int) -> int:
    """A few backward programs per SM, each striding over the row tiles: few (programs, D) partials
    (single pass), or looped_bytes_per_sm of x and dy chunks in flight (looped)."""
    if sms == 0:
        return _INTERPRETER_PROGRAMS
    if not tiles.single_pass:
        per_sm = max(1, config.looped_bytes_per_sm // (2 * tiles.block_m * tiles.block_d * element_size))
    elif tiles.block_d > config.backward_block_max:
        per_sm = 1  # a 16384-wide program's registers fill an SM: a second one only waits
    else:
        per_sm = config.backward_programs_per_sm
    return per_sm * sms


def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device.index) if device.type == "cuda" else 0


# The choices for the picked config, once per (device, shape): per call a dict lookup. Keyed by device
# (its architecture and SM count); bounded, as a run with varying row counts adds one per count.
@functools.lru_cache(maxsize=1024)
def _picked_forward_tiles(device: torch.device, d: int) -> RowTiles:
    return forward_tiles(norm_config(device_arch(device)), d)


@functools.lru_cache(maxsize=1024)
def _picked_backward(device: torch.device, d: int, m: int, element_size: int, rms: bool):
    """(config, tiles, programs) of the backward."""
    config = norm_config(device_arch(device))
    return config, *backward_tiles(config, d, m, element_size, rms, _multiprocessors(device))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


# Eager ticket counters of the dw / db sums, per (device index, stream): launches on one stream run
# one after another and each leaves its counters at 0, so the next finds them ready. Limits: a
# kernel that dies mid-launch leaves them unusable (as it leaves the CUDA context); a kernel
# launched on a device other than the current one runs on that device's stream, not on the stream
# its counters are keyed by, and could share them with a concurrent launch.
_COUNTERS: dict = {}


def _counters(device: torch.device, n: int, traced: bool) -> torch.Tensor:
    """At least ``n`` int32 counters at 0 for one backward launch on the current stream, which
    leaves them at 0. Traced (Inductor's CUDA graphs replay the zeroing) and while a CUDA graph is
    being captured: fresh zeroed ones, as a graph replays on whatever stream it is given and so
    must own its counters."""
    if traced or (device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()):
        return torch.zeros(n, dtype=torch.int32, device=device)
    if device.type == "cuda":  # the stream the launch goes to: the current device's (as Triton's)
        current = torch.cuda.current_device()
        key = (device.index, current, torch._C._cuda_getCurrentRawStream(current))
    else:
        key = (device.type, None, None)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < n:
        # (a smaller buffer it replaces goes back to the allocator in stream order, after its last use)
        counters = _COUNTERS[key] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return counters


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` for the kernels, with its row stride: a contiguous tensor of any rank as it is (row r
    starts at r * D; no view to make), any other as as_rows' (R, D) view or copy."""
    if t.is_contiguous():
        return t, t.shape[-1]
    rows = as_rows(t)
    return rows, rows.stride(0)


def _row_count(x: torch.Tensor) -> int:
    d = x.shape[-1]
    return x.numel() // d if d else math.prod(x.shape[:-1])


def _forward(x, weight, bias, eps: float, rms: bool, out_dtype: torch.dtype, traced: bool = False, config=None):
    """(y (x's shape, contiguous, out_dtype), mean - x[:, 0] (M,) fp32 or None, rstd (M,) fp32); ``traced``
    inside the triton_op; ``config`` None picks `norm_config`'s."""
    m, d = _row_count(x), x.shape[-1]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, mean, rstd
    if not runs_triton(x):
        _reference_forward(as_rows(x), weight, bias, eps, rms, y.view(m, d), mean, rstd)
        return y, mean, rstd
    if config is None and not traced:
        tiles = _picked_forward_tiles(x.device, d)
    else:  # (traced, the sizes may be symbolic, which no cache takes)
        tiles = forward_tiles(config if config is not None else norm_config(device_arch(x.device)), d)
    rows, stride_x = _rows(x)
    kernel = wrap_triton(_norm_forward_kernel) if traced else eager_kernel(_norm_forward_kernel)
    kernel[(cdiv(m, tiles.block_m),)](
        rows, weight if weight is not None else rows, bias if bias is not None else rows, y,
        mean if mean is not None else rstd, rstd, stride_x, m, d, eps,
        RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m,
        BLOCK_D=tiles.block_d, SINGLE_PASS=tiles.single_pass, num_warps=tiles.num_warps,
    )  # fmt: skip
    return y, mean, rstd


def _backward(
    dy, x, weight, mean, rstd, rms: bool, weight_grad: bool, bias_grad: bool, traced: bool = False, config=None
):
    """(dx (x's shape, contiguous), dw (D,) or None, db (D,) or None): one launch for rows held in
    registers up to fused_sum_max_d wide, else two (dx and partial sums, then dw / db); ``traced``
    inside the triton_op; ``config`` None picks `norm_config`'s."""
    m, d = _row_count(x), x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(d, dtype=weight.dtype, device=x.device) if weight_grad else None
    db = torch.empty(d, dtype=weight.dtype if weight is not None else x.dtype, device=x.device) if bias_grad else None
    if x.numel() == 0 or not runs_triton(x):
        _reference_backward(as_rows(dy), as_rows(x), weight, mean, rstd, rms, dx.view(m, d), dw, db)
        return dx, dw, db
    if config is None and not traced:
        config, tiles, programs = _picked_backward(x.device, d, m, x.element_size(), rms)
    else:
        config = config if config is not None else norm_config(device_arch(x.device))
        tiles, programs = backward_tiles(config, d, m, x.element_size(), rms, _multiprocessors(x.device))
    rows, stride_x = _rows(x)
    dy_rows, stride_dy = _rows(dy)
    mean_or_dummy = mean if mean is not None else rstd
    dw_or_dummy, db_or_dummy = dw if weight_grad else rstd, db if bias_grad else rstd
    # partial rows of dw / db: one per backward program (single pass) or per row group (wide rows);
    # ticket counters for the sums made inside a launch: the single-pass backward's (rows up to
    # fused_sum_max_d wide; one per group of programs and one more) or the wide rows' dw / db
    # kernel's (one per column block)
    grads = weight_grad + bias_grad
    fused_sum = tiles.single_pass and d <= config.fused_sum_max_d
    if tiles.single_pass:
        partial_rows, tickets = programs, cdiv(programs, config.fused_sum_group) + 1 if fused_sum else 0
    else:
        partial_rows, tickets = min(config.param_grad_groups, m), cdiv(d, config.param_grad_block_d)
    partial = torch.empty((grads, partial_rows, d), dtype=torch.float32, device=x.device) if grads else rstd
    counters = _counters(x.device, tickets, traced) if grads and tickets else rstd
    kernel = wrap_triton(_norm_backward_kernel) if traced else eager_kernel(_norm_backward_kernel)
    kernel[(programs,)](
        rows, weight if weight is not None else rows, dy_rows, dx, mean_or_dummy, rstd, partial, dw_or_dummy,
        db_or_dummy, counters, stride_x, stride_dy, m, d,
        RMS=rms, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
        BLOCK_M=tiles.block_m, BLOCK_D=tiles.block_d, SINGLE_PASS=tiles.single_pass, FUSED_SUM=fused_sum,
        SUM_GROUP=config.fused_sum_group, SUM_BLOCK_D=config.fused_sum_block_d, num_warps=tiles.num_warps,
    )  # fmt: skip
    if grads and tiles.single_pass and not fused_sum:
        kernel = wrap_triton(_sum_partials_kernel) if traced else eager_kernel(_sum_partials_kernel)
        kernel[(cdiv(d, config.sum_block_d),)](
            partial, dw_or_dummy, db_or_dummy, programs, d, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
            BLOCK_P=config.sum_block_p, BLOCK_D=config.sum_block_d, num_warps=4,
        )  # fmt: skip
    if grads and not tiles.single_pass:
        kernel = wrap_triton(_norm_param_grad_kernel) if traced else eager_kernel(_norm_param_grad_kernel)
        kernel[(cdiv(d, config.param_grad_block_d), partial_rows)](
            rows, dy_rows, mean_or_dummy, rstd, partial, dw_or_dummy, db_or_dummy, counters, stride_x, stride_dy,
            m, d, cdiv(m, partial_rows), RMS=rms, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
            BLOCK_M=config.param_grad_block_m, BLOCK_D=config.param_grad_block_d, SUM_GROUP=config.fused_sum_group,
            num_warps=config.param_grad_warps,
        )  # fmt: skip
    return dx, dw, db


def _reference_forward(rows, weight, bias, eps, rms, y_rows, mean, rstd):
    x = rows.float()
    if rms:
        centered = x
    else:  # about x[row, 0], saving mean - x[row, 0], as the kernels do
        shifted = x - x[:, :1]
        mean.copy_(shifted.mean(dim=-1))
        centered = shifted - mean[:, None]
    rstd.copy_(torch.rsqrt(centered.square().mean(dim=-1) + eps))
    out = centered * rstd[:, None]
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    y_rows.copy_(out)


def _reference_backward(dy_rows, rows, weight, mean, rstd, rms, dx_rows, dw, db):
    x, dy = rows.float(), dy_rows.float()
    x_hat = (x if rms else x - x[:, :1] - mean[:, None]) * rstd[:, None]
    g = dy * weight.float() if weight is not None else dy
    out = g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
    if not rms:
        out = out - g.mean(dim=-1, keepdim=True)
    dx_rows.copy_(out * rstd[:, None])
    if dw is not None:
        dw.copy_((dy * x_hat).sum(dim=0))
    if db is not None:
        db.copy_(dy.sum(dim=0))


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::norm_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean - x[:, 0], rstd); that mean is an empty tensor for RMSNorm (ops cannot return None)."""
    y, mean, rstd = _forward(x, weight, bias, eps, rms, out_dtype, traced=True)
    return y, (rstd.new_empty(0) if mean is None else mean), rstd


@torch.library.triton_op("fastlm::norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw / db are empty tensors when not requested."""
    dx, dw, db = _backward(dy, x, weight, None if rms else mean, rstd, rms, weight_grad, bias_grad, traced=True)
    empty = rstd.new_empty(0)
    return dx, (empty if dw is None else dw), (empty if db is None else db)


def _op_setup_context(ctx, inputs, output):
    x, weight, bias, eps, rms, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms = rms
    ctx.mark_non_differentiable(mean, rstd)


def _op_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dx, dw, db = _backward_op(dy, x, weight, mean, rstd, ctx.rms, weight_grad, bias_grad)
    return dx, (dw if weight_grad else None), (db if bias_grad else None), None, None, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


# Eager: the same launchers behind a plain autograd.Function (a torch.library call costs tens of
# microseconds of Python, as much as the kernel on small rows).


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, out_dtype, config):
        y, mean, rstd = _forward(x, weight, bias, eps, rms, out_dtype, config=config)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.config = rms, config
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _backward(dy, x, weight, mean, rstd, ctx.rms, weight_grad, bias_grad, config=ctx.config)
        return dx, dw, db, None, None, None, None


def _apply(x, weight, bias, eps: float, rms: bool, out_dtype: torch.dtype | None, config=None) -> torch.Tensor:
    """The norm through autograd; ``config`` (eager only; None picks `norm_config`'s) for tests and tuning."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        return _forward_op(x, weight, bias, eps, rms, out_dtype)[0]
    return NormFunction.apply(x, weight, bias, eps, rms, out_dtype, config)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps, out_dtype: torch.dtype | None = None
) -> float:
    """One clear error for each bad argument; returns eps as a float (an int eps would compile a
    kernel of its own)."""
    check_tensor("x", x)
    check_optional_tensor("weight", weight)
    check_optional_tensor("bias", bias)
    eps = check_number("eps", eps, 0.0)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the normalized one)")
    check_dtype("x", x, DTYPES)
    if out_dtype is not None and out_dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"out_dtype must be one of ({names}) or None, got {out_dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if param.dim() != 1 or param.shape[0] != x.shape[-1]:
            raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, "
                             f"got {tuple(param.shape)}")  # fmt: skip
        check_dtype(name, param, DTYPES)
        if param.device != x.device:
            check_same_device(x=x, **{name: param})
    return eps


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any rank); statistics in fp32, output in ``out_dtype``
    (default: x's dtype). Same values as ``torch.nn.functional.layer_norm(x, x.shape[-1:], weight,
    bias, eps).to(out_dtype)``, rounded once: an fp32 x normalized straight into bf16 for the
    matmul that follows skips a full-width fp32 write and the cast pass."""
    eps = check_inputs(x, weight, bias, eps, out_dtype)
    return _apply(x, weight, bias, eps, False, out_dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in
    ``out_dtype`` (default: x's dtype). Same values as ``torch.nn.functional.rms_norm(x,
    x.shape[-1:], weight, eps).to(out_dtype)``."""
    eps = check_inputs(x, weight, None, eps, out_dtype)
    return _apply(x, weight, None, eps, True, out_dtype)


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch in fp32, or float64 for float64 inputs: the reference the kernels are tested against."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = torch.nn.functional.layer_norm(x.to(compute), x.shape[-1:], None, None, eps)
    out = out * weight.to(compute) if weight is not None else out
    return (out + bias.to(compute) if bias is not None else out).to(x.dtype)


def rms_norm_ref(x, weight=None, eps=1e-5):
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    out = xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    return (out * weight.to(compute) if weight is not None else out).to(x.dtype)
