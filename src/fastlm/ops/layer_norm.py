"""LayerNorm and RMSNorm over the last dimension: fused Triton forward and backward.

    layer_norm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
    rms_norm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)

Input (..., D) of any rank is viewed as rows (M, D). One kernel family serves both norms
(`RMS` drops the centering). Statistics (mean, rstd: (M,) fp32) are saved for the backward:

    x_hat = (x - mean) * rstd,  g = dy * w
    dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g))       (RMSNorm: without the mean(g) term)
    dw = sum_rows dy * x_hat,   db = sum_rows dy

Both row reductions of dx come from one pass over the row. dw and db are reduced without
atomics: a few programs per SM each take every programs-th tile of rows and write their partial
sums to their own row of a (programs, D) fp32 buffer, which a second small kernel sums column by
column in a fixed order and casts to the parameters' dtype; they are skipped when the weight /
bias do not require grad.

Rows up to FORWARD_BLOCK_MAX / BACKWARD_BLOCK_MAX (16-bit RMSNorm: RMS_16BIT_BACKWARD_BLOCK_MAX)
wide are held in registers (one read of x in the forward, one of x and dy in the backward),
several narrow rows to a (BLOCK_M, BLOCK_D) tile; wider rows (up to 65536 and beyond) loop over
column chunks, re-reading the row once per pass (forward: statistics, then output; backward: sums,
then dx), and their dw / db come from a second kernel that streams x and dy again by column blocks
(4MD more bytes read in bf16, none read-modify-written).

Bytes (bf16 x, fp32 statistics, ignoring the small weight): forward 2MD read + 2MD written;
backward 4MD read (x, dy) + 2MD written (dx).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from fastlm.ops.common import (
    RowTiles,
    as_rows,
    cdiv,
    check_dtype,
    check_same_device,
    multiprocessors,
    row_tiles,
    runs_triton,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widest rows held in registers (one read of each input); wider rows loop over chunks of this size.
# The backward keeps more per element (x, dy, the dw / db accumulators), so its limit is lower.
FORWARD_BLOCK_MAX = 16384
BACKWARD_BLOCK_MAX = 8192
# RMSNorm of 16-bit rows keeps rows up to this wide in registers in the backward too: x, dy and its
# one dw accumulator, 32 values each per thread at 16 warps. On an H100 at 4096x16384 bf16 it takes
# 0.186 ms against 0.277 ms looped; LayerNorm (a db accumulator and the mean more) and fp32 rows
# spill at that width (0.17-0.52 TB/s; benchmarks/results/norms_tuning_h100.jsonl).
RMS_16BIT_BACKWARD_BLOCK_MAX = 16384


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _norm_forward_kernel(
    X,  # (M, D) input rows, row stride stride_x
    W,  # (D,) weight, or a dummy when HAS_WEIGHT is False
    B,  # (D,) bias, or a dummy when HAS_BIAS is False
    Y,  # (M, D) output, row stride stride_y
    MEAN,  # (M,) fp32 mean (written for LayerNorm only)
    RSTD,  # (M,) fp32 1 / sqrt(var + eps)
    stride_x,
    stride_y,
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
        else:
            mean = tl.sum(x, axis=1) / D
            centered = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=row_mask)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / D + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        x_row, y_row = X + row * stride_x, Y + row * stride_y
        mean = 0.0
        if not RMS:
            total = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for start in range(0, D, BLOCK_D):
                x = tl.load(x_row + start + cols, mask=start + cols < D, other=0.0).to(tl.float32)
                total += x
            mean = tl.sum(total, axis=0) / D
            tl.store(MEAN + row, mean)
        squares = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, D, BLOCK_D):  # second pass: variance around the exact mean
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            centered = tl.where(mask, x - mean, 0.0)
            squares += centered * centered
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / D + eps)
        tl.store(RSTD + row, rstd)
        for start in range(0, D, BLOCK_D):
            mask = start + cols < D
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd
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
def _norm_backward_kernel(
    X,  # (M, D) input rows of the forward
    W,  # (D,) weight, or a dummy when HAS_WEIGHT is False
    DY,  # (M, D) upstream gradient
    DX,  # (M, D) input gradient (output)
    MEAN,  # (M,) fp32 (LayerNorm only)
    RSTD,  # (M,) fp32
    DW_PARTIAL,  # (programs, D) fp32: this program's sum of dy * x_hat over its rows
    DB_PARTIAL,  # (programs, D) fp32: this program's sum of dy over its rows
    stride_x,
    stride_dy,
    stride_dx,
    M,
    D,
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile, or per (BLOCK_M, BLOCK_D) chunk when looping
    BLOCK_D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):
    # Program p takes the row tiles p, p + programs, p + 2 programs, ...
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    partial_row = pid.to(tl.int64) * D
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
            mean = 0.0 if RMS else tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy * w
            dx = g - x_hat * (tl.sum(g * x_hat, axis=1) / D)[:, None]
            if not RMS:
                dx = dx - (tl.sum(g, axis=1) / D)[:, None]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (dx * rstd).to(DX.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw += dy * x_hat
            if BIAS_GRAD:
                db += dy
        if WEIGHT_GRAD:
            tl.store(DW_PARTIAL + partial_row + cols, tl.sum(dw, axis=0), mask=col_mask)
        if BIAS_GRAD:
            tl.store(DB_PARTIAL + partial_row + cols, tl.sum(db, axis=0), mask=col_mask)
    else:
        # dx only: the dw / db partials of wide rows come from _norm_param_grad_kernel
        for tile in range(pid, tl.cdiv(M, BLOCK_M), programs):
            rows = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
            mean = 0.0 if RMS else tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
            gx = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            gs = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for start in range(0, D, BLOCK_D):  # pass 1: both row reductions
                x, dy, mask, col_mask = _load_chunk(X, DY, rows, row_mask, start + cols, D, stride_x, stride_dy)
                w = tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else 1.0
                g = dy * w
                gx += g * tl.where(mask, (x - mean) * rstd, 0.0)
                gs += g
            mean_gx = (tl.sum(gx, axis=1) / D)[:, None]
            mean_g = 0.0 if RMS else (tl.sum(gs, axis=1) / D)[:, None]
            # pass 2 re-reads the rows, from L2 (they were read a moment ago, and few are in flight)
            for start in range(0, D, BLOCK_D):  # pass 2: dx
                x, dy, mask, col_mask = _load_chunk(X, DY, rows, row_mask, start + cols, D, stride_x, stride_dy)
                w = tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] if HAS_WEIGHT else 1.0
                x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
                dx = (dy * w - x_hat * mean_gx - mean_g) * rstd
                tl.store(
                    DX + rows[:, None] * stride_dx + (start + cols)[None, :], dx.to(DX.dtype.element_ty), mask=mask
                )


@triton.jit
def _norm_param_grad_kernel(
    X,  # (M, D) input rows of the forward
    DY,  # (M, D) upstream gradient
    MEAN,  # (M,) fp32 (LayerNorm only)
    RSTD,  # (M,) fp32
    DW_PARTIAL,  # (groups, D) fp32: this row group's sum of dy * x_hat
    DB_PARTIAL,  # (groups, D) fp32: this row group's sum of dy
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
):
    """dw / db partials of rows too wide for the single-pass backward. Program (c, g) sums column
    block c over row group g in (BLOCK_M, BLOCK_D) registers and writes one partial row: x and dy
    are read a second time, but streamed, where a read-modify-write of a (programs, D) partial per
    row chunk in the dx kernel made the L2 overflow. Grid (cdiv(D, BLOCK_D), groups)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    group = tl.program_id(1).to(tl.int64)
    first = group * ROWS_PER_GROUP
    end = tl.minimum(first + ROWS_PER_GROUP, M)
    dw = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(first, end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        x, dy, mask, _ = _load_chunk(X, DY, rows, row_mask, cols, D, stride_x, stride_dy)
        if WEIGHT_GRAD:
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
            mean = 0.0 if RMS else tl.load(MEAN + rows, mask=row_mask, other=0.0)[:, None]
            dw += dy * tl.where(mask, (x - mean) * rstd, 0.0)
        if BIAS_GRAD:
            db += dy
    col_mask = cols < D
    if WEIGHT_GRAD:
        tl.store(DW_PARTIAL + group * D + cols, tl.sum(dw, axis=0), mask=col_mask)
    if BIAS_GRAD:
        tl.store(DB_PARTIAL + group * D + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    DW_PARTIAL,  # (P, D) fp32: one row per backward program
    DB_PARTIAL,  # (P, D) fp32, or a dummy when BIAS_GRAD is False
    DW,  # (D,) dw in the weight's dtype, or a dummy when WEIGHT_GRAD is False
    DB,  # (D,) db in the bias's dtype, or a dummy
    P,
    D,
    WEIGHT_GRAD: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dw and db: the column sums of the partial rows, in a fixed order (deterministic), cast once;
    one launch where `sum(dim=0)` and `.to()` per gradient would be four. Grid cdiv(D, BLOCK_D)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_mask[None, :]
        offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
        if WEIGHT_GRAD:
            dw += tl.sum(tl.load(DW_PARTIAL + offsets, mask=mask, other=0.0), axis=0)
        if BIAS_GRAD:
            db += tl.sum(tl.load(DB_PARTIAL + offsets, mask=mask, other=0.0), axis=0)
    if WEIGHT_GRAD:
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=col_mask)
    if BIAS_GRAD:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


# Elements per (BLOCK_M, BLOCK_D) tile and per warp, forward and backward: small rows are stacked
# into tiles so every program moves enough bytes. Chosen by benchmarks/tune_norms.py on an H100
# (best geometric mean over the benchmark shapes, bf16 and fp32; forward 2.6-2.9 TB/s, single-pass
# backward 1.9-2.8 TB/s at a 3.0 TB/s copy; benchmarks/results/norms_tuning_h100.jsonl).
FORWARD_TILE, FORWARD_PER_WARP = 2048, 512
BACKWARD_TILE, BACKWARD_PER_WARP = 4096, 512
BACKWARD_PROGRAMS_PER_SM = 2
# The partial-row sum: (SUM_BLOCK_P, SUM_BLOCK_D) fp32 tiles, one program per SUM_BLOCK_D columns. Narrow
# column blocks give enough programs for 1024-wide rows (64 against 8 with 128 columns): the sum of
# 264 x 1024 partials of dw and db on an H100 takes 10 us against 37 us (benchmarks/tune_norms.py
# --sweep sum).
SUM_BLOCK_P, SUM_BLOCK_D = 256, 16
# The looped backward (D > BACKWARD_BLOCK_MAX) computes dx only, on chunks of LOOPED_BACKWARD_ROWS rows.
# Its pass 2 re-reads each chunk from L2. Programs per SM: as many as keep LOOPED_BYTES_PER_SM of x and
# dy chunks in flight, so 2 in bf16 and 1 in fp32 (a second fp32 program measured 9% slower for
# RMSNorm, a single bf16 one 16% slower). From benchmarks/tune_norms.py --sweep bwd,param 16384 on an
# H100 (benchmarks/results/norms_tuning_h100.jsonl).
LOOPED_BACKWARD_ROWS = 1
LOOPED_BYTES_PER_SM = 64 * 1024
# dw / db of wide rows (_norm_param_grad_kernel): (PARAM_GRAD_BLOCK_M, PARAM_GRAD_BLOCK_D) tiles
# over PARAM_GRAD_GROUPS row groups, so cdiv(D, 512) x 16 programs and a (16, D) partial to sum.
PARAM_GRAD_BLOCK_M, PARAM_GRAD_BLOCK_D, PARAM_GRAD_WARPS = 8, 512, 4
PARAM_GRAD_GROUPS = 16


def forward_config(d: int) -> RowTiles:
    return row_tiles(d, FORWARD_TILE, FORWARD_PER_WARP, FORWARD_BLOCK_MAX)


def backward_config(d: int, m: int, device: torch.device, element_size: int, rms: bool) -> RowTiles:
    """Rows up to BACKWARD_BLOCK_MAX wide (RMS_16BIT_BACKWARD_BLOCK_MAX for 16-bit RMSNorm): stacked
    tiles, one pass. Wider: chunks of up to LOOPED_BACKWARD_ROWS rows x (BACKWARD_BLOCK_MAX / that)
    columns, fewer rows per chunk when there are too few rows to give every backward program a tile
    of that many."""
    block_max = RMS_16BIT_BACKWARD_BLOCK_MAX if rms and element_size == 2 else BACKWARD_BLOCK_MAX
    tiles = row_tiles(d, BACKWARD_TILE, BACKWARD_PER_WARP, block_max)
    if tiles.single_pass:
        return tiles
    rows = LOOPED_BACKWARD_ROWS  # a power of two (tl.arange)
    while rows > 1:
        chunks = RowTiles(rows, BACKWARD_BLOCK_MAX // rows, False, tiles.num_warps)
        if rows <= m and cdiv(m, rows) >= _backward_programs(m, device, chunks, element_size):
            return chunks
        rows //= 2
    return RowTiles(1, BACKWARD_BLOCK_MAX, False, tiles.num_warps)


def _backward_programs(tiles: int, device: torch.device, config: RowTiles, element_size: int) -> int:
    """A few programs per SM, each striding over the row tiles: few (programs, D) partials (single
    pass), or LOOPED_BYTES_PER_SM of x and dy chunks in flight (looped)."""
    if device.type != "cuda":
        return min(tiles, 4)
    if not config.single_pass:
        per_sm = max(1, LOOPED_BYTES_PER_SM // (2 * config.block_m * config.block_d * element_size))
    elif config.block_d > BACKWARD_BLOCK_MAX:
        per_sm = 1  # a 16384-wide program's registers fill an SM: a second one only waits (6% slower)
    else:
        per_sm = BACKWARD_PROGRAMS_PER_SM
    return min(tiles, per_sm * multiprocessors(device.index or 0))


def _forward(x, weight, bias, eps: float, rms: bool, out_dtype: torch.dtype, traced: bool = False):
    """(y (x's shape, out_dtype), mean (M,) fp32 or None, rstd (M,) fp32); ``traced`` inside the
    triton_op."""
    rows = as_rows(x)
    m, d = rows.shape
    y = torch.empty((m, d), dtype=out_dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y.view(x.shape), mean, rstd
    if not runs_triton(x):
        return _reference_forward(rows, weight, bias, eps, rms, y, mean, rstd, x.shape)
    config = forward_config(d)
    kernel = wrap_triton(_norm_forward_kernel) if traced else _norm_forward_kernel
    kernel[(cdiv(m, config.block_m),)](
        rows, weight if weight is not None else rows, bias if bias is not None else rows, y,
        mean if mean is not None else rstd, rstd, rows.stride(0), y.stride(0), m, d, eps,
        RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
        BLOCK_D=config.block_d, SINGLE_PASS=config.single_pass, num_warps=config.num_warps,
    )  # fmt: skip
    return y.view(x.shape), mean, rstd


def _backward(dy, x, weight, mean, rstd, rms: bool, weight_grad: bool, bias_grad: bool, traced: bool = False):
    """(dx like x, dw (D,) or None, db (D,) or None); ``traced`` inside the triton_op."""
    rows, dy_rows = as_rows(x), as_rows(dy)
    m, d = rows.shape
    dx = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0 or not runs_triton(x):
        return _reference_backward(dy_rows, rows, weight, mean, rstd, rms, weight_grad, bias_grad, dx, x.shape)
    config = backward_config(d, m, x.device, x.element_size(), rms)
    programs = _backward_programs(cdiv(m, config.block_m), x.device, config, x.element_size())
    mean_or_dummy = mean if mean is not None else rstd
    # partial rows of dw / db: one per backward program (single pass) or per row group (wide rows)
    partials = programs if config.single_pass else min(PARAM_GRAD_GROUPS, m)
    dw_partial = torch.empty((partials, d), dtype=torch.float32, device=x.device) if weight_grad else rstd
    db_partial = torch.empty((partials, d), dtype=torch.float32, device=x.device) if bias_grad else rstd
    kernel = wrap_triton(_norm_backward_kernel) if traced else _norm_backward_kernel
    kernel[(programs,)](
        rows, weight if weight is not None else rows, dy_rows, dx, mean_or_dummy, rstd,
        dw_partial, db_partial, rows.stride(0), dy_rows.stride(0), dx.stride(0), m, d,
        RMS=rms, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
        BLOCK_M=config.block_m, BLOCK_D=config.block_d, SINGLE_PASS=config.single_pass, num_warps=config.num_warps,
    )  # fmt: skip
    if not config.single_pass and (weight_grad or bias_grad):
        param_grad = wrap_triton(_norm_param_grad_kernel) if traced else _norm_param_grad_kernel
        param_grad[(cdiv(d, PARAM_GRAD_BLOCK_D), partials)](
            rows, dy_rows, mean_or_dummy, rstd, dw_partial, db_partial, rows.stride(0), dy_rows.stride(0), m, d,
            cdiv(m, partials), RMS=rms, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
            BLOCK_M=PARAM_GRAD_BLOCK_M, BLOCK_D=PARAM_GRAD_BLOCK_D, num_warps=PARAM_GRAD_WARPS,
        )  # fmt: skip
    dw = torch.empty(d, dtype=weight.dtype, device=x.device) if weight_grad else None
    db = torch.empty(d, dtype=weight.dtype if weight is not None else x.dtype, device=x.device) if bias_grad else None
    if weight_grad or bias_grad:
        kernel = wrap_triton(_sum_partials_kernel) if traced else _sum_partials_kernel
        kernel[(cdiv(d, SUM_BLOCK_D),)](
            dw_partial, db_partial, dw if weight_grad else db, db if bias_grad else dw, partials, d,
            WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad, BLOCK_P=SUM_BLOCK_P, BLOCK_D=SUM_BLOCK_D, num_warps=4,
        )  # fmt: skip
    return dx.view(x.shape), dw, db


def _reference_forward(rows, weight, bias, eps, rms, y, mean, rstd, shape):
    x = rows.float()
    centered = x if rms else x - x.mean(dim=-1, keepdim=True)
    if mean is not None:
        mean.copy_(x.mean(dim=-1))
    rstd.copy_(torch.rsqrt(centered.square().mean(dim=-1) + eps))
    out = centered * rstd[:, None]
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    y.copy_(out)
    return y.view(shape), mean, rstd


def _reference_backward(dy_rows, rows, weight, mean, rstd, rms, weight_grad, bias_grad, dx, shape):
    x, dy = rows.float(), dy_rows.float()
    x_hat = (x if rms else x - mean[:, None]) * rstd[:, None]
    g = dy * weight.float() if weight is not None else dy
    out = g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
    if not rms:
        out = out - g.mean(dim=-1, keepdim=True)
    dx.copy_(out * rstd[:, None])
    dw = (dy * x_hat).sum(dim=0).to(weight.dtype) if weight_grad else None
    db = dy.sum(dim=0).to(weight.dtype if weight is not None else dx.dtype) if bias_grad else None
    return dx.view(shape), dw, db


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
    """(y, mean, rstd); mean is an empty tensor for RMSNorm (ops cannot return None)."""
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
    def forward(ctx, x, weight, bias, eps, rms, out_dtype):
        y, mean, rstd = _forward(x, weight, bias, eps, rms, out_dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms = rms
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _backward(dy, x, weight, mean, rstd, ctx.rms, weight_grad, bias_grad)
        return dx, dw, db, None, None, None


def _apply(x, weight, bias, eps: float, rms: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        return _forward_op(x, weight, bias, eps, rms, out_dtype)[0]
    return NormFunction.apply(x, weight, bias, eps, rms, out_dtype)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> None:
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the normalized one)")
    check_dtype("x", x, DTYPES)
    if out_dtype is not None and out_dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"out_dtype must be one of ({names}) or None, got {out_dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if param.shape != x.shape[-1:]:
            raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, "
                             f"got {tuple(param.shape)}")  # fmt: skip
        check_dtype(name, param, DTYPES)
        check_same_device(x=x, **{name: param})


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
    check_inputs(x, weight, bias, out_dtype)
    return _apply(x, weight, bias, eps, False, out_dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in
    ``out_dtype`` (default: x's dtype). Same values as ``torch.nn.functional.rms_norm(x,
    x.shape[-1:], weight, eps).to(out_dtype)``."""
    check_inputs(x, weight, None, out_dtype)
    return _apply(x, weight, None, eps, True, out_dtype)


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch, fp32 math: the reference the kernels are tested against."""
    out = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], None, None, eps)
    out = out * weight.float() if weight is not None else out
    return (out + bias.float() if bias is not None else out).to(x.dtype)


def rms_norm_ref(x, weight=None, eps=1e-5):
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return (out * weight.float() if weight is not None else out).to(x.dtype)
