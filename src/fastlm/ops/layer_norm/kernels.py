"""The LayerNorm / RMSNorm kernels: the math, the algorithm and the `@triton.jit` functions.

    layer_norm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)
    rms_norm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)

w is the weight plus ``weight_offset`` (an fp32 scalar added to the weight's fp32 value, 0 but for
Gemma's RMSNorm, x * rstd * (1 + weight)): dw is the same either way.

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
`_last_to_arrive`; `launchers._counters` says where the counters live and what that allows). One program
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

import triton
import triton.language as tl


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
    weight_offset,  # added to each weight (fp32), 0 but for (1 + weight) norms
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (a (BLOCK_M, BLOCK_D) tile; 1 when looping)
    BLOCK_D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,  # BLOCK_D >= D: the rows stay in registers
):
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64: keep the math in fp32
    weight_offset = tl.cast(weight_offset, tl.float32)
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
            y = y * _offset_weight(W, cols, col_mask, weight_offset)
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
                y = y * (tl.load(W + start + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
            if HAS_BIAS:
                y = y + tl.load(B + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _offset_weight(W, cols, col_mask, weight_offset):
    """(1, BLOCK_D) fp32 weight + weight_offset at ``cols``."""
    return (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset)[None, :]


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
    weight_offset,  # added to each weight (fp32), as in the forward
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
    weight_offset = tl.cast(weight_offset, tl.float32)
    if SINGLE_PASS:
        col_mask = cols < D
        w = _offset_weight(W, cols, col_mask, weight_offset) if HAS_WEIGHT else 1.0
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
                w = _offset_weight(W, start + cols, col_mask, weight_offset) if HAS_WEIGHT else 1.0
                g = dy * w
                gx += g * tl.where(mask, (x - x0 - mean) * rstd, 0.0)
                gs += g
            mean_gx = (tl.sum(gx, axis=1) / D)[:, None]
            mean_g = 0.0 if RMS else (tl.sum(gs, axis=1) / D)[:, None]
            # pass 2 re-reads the rows, from L2 (they were read a moment ago, and few are in flight)
            for start in range(0, D, BLOCK_D):  # pass 2: dx
                x, dy, mask, col_mask = _load_chunk(X, DY, rows, row_mask, start + cols, D, stride_x, stride_dy)
                w = _offset_weight(W, start + cols, col_mask, weight_offset) if HAS_WEIGHT else 1.0
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
        tl.store(
            DW + cols, _column_sums(PARTIAL, 0, 1, P, D, cols, BLOCK_P, BLOCK_D).to(DW.dtype.element_ty), mask=col_mask
        )
    if BIAS_GRAD:
        DB_PARTIAL = PARTIAL + P * D if WEIGHT_GRAD else PARTIAL
        tl.store(
            DB + cols,
            _column_sums(DB_PARTIAL, 0, 1, P, D, cols, BLOCK_P, BLOCK_D).to(DB.dtype.element_ty),
            mask=col_mask,
        )
