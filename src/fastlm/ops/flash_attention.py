"""FlashAttention-2: Triton forward and backward kernels, a tiled PyTorch twin, autograd, public API.

Math, per head, with queries Q (M, D), keys K (N, D), values V (N, D) and scale c:

    S = c * Q K^T            P = softmax(S) row-wise         O = P V        L = logsumexp(S) row-wise
    dV = P^T dO              dP = dO V^T                     Dlt = rowsum(dO * O)
    dS = P * (dP - Dlt)      dQ = c * dS K                   dK = c * dS^T Q

FlashAttention-2 (Dao, 2023) never materializes S or P: the forward streams key tiles past a
query tile held on chip, keeping a running max m, running sum l and an fp32 accumulator
(online softmax), and saves only O and L. The backward recomputes P = exp(S - L) tile by tile.

Causal masking: query i sees key j iff j <= i + (N - M), i.e. the mask is aligned bottom-right
as in FlashAttention-2 (for M == N it is the usual j <= i). When M > N the first M - N query
rows see no key; they return 0 and have L = -inf. Masked scores are -inf, never NaN.

Cost model, one head (bytes of q/k/v elements ``s``); three launches for a forward and backward:
    forward   4*M*N*D FLOPs (two matmuls; half of it under a causal mask when M == N),
              reads (M + 2N)*D*s, writes M*D*s + 4M             -> compute bound for N >> D
    backward  two launches, in this order (the stream orders them: the second reads what the
              first wrote). dQ kernel: 3 matmuls per tile (S, dP, dQ); each program reads its
              Q, dO and O tiles once (O only for Dlt = rowsum(dO * O): M*D*s per head in all),
              writes dQ and stores Dlt (4M bytes). dK/dV kernel: 4 matmuls per tile (S, dP, dV,
              dK), reads L and that Dlt. That is 7 matmuls where an atomic-add backward needs 5:
              the price of gradients that are bit-for-bit reproducible. Benchmarks count the
              conventional 2.5x forward FLOPs.

Grouped-query attention: query head h reads key/value head h // (H // Hkv). The dK/dV kernel
loops over the H // Hkv query heads of its group, so no two programs write the same gradient.
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
    cdiv,
    check_dtype,
    check_flag,
    check_number,
    check_same_device,
    check_tensor,
    device_arch,
    next_power_of_2,
    runs_triton,
)
from fastlm.ops.launch import eager_kernel

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Start value of the running max (log2 units): finite, so exp2(m_old - m_new) is 0, not NaN, while
# every score seen so far is masked.
RUNNING_MAX_START = tl.constexpr(-3.0e38)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Tile edge of the plain-PyTorch twin (FlashAttentionTorch).
TORCH_TILE = 32


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(
    ptrs,  # (ROWS, BLOCK_D) pointers
    rows,  # (ROWS,) row indices of the tile
    n_rows,  # rows in the tensor; rows >= n_rows load as 0
    CHECK_ROWS: tl.constexpr,  # the tile may run past n_rows
    HEAD_DIM: tl.constexpr,  # real head dim
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two (>= 16 for tl.dot)
):
    """Load a (ROWS, BLOCK_D) tile, masking only what can be out of bounds."""
    cols = tl.arange(0, BLOCK_D)
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _key_range(start_m, M, N, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles a query tile [start_m, start_m + BLOCK_M) visits: (full_end, end).

    Keys in [0, full_end) are whole tiles every row of the tile sees (no mask needed); keys in
    [full_end, end) need the causal and/or key-bounds mask; keys >= end are skipped (tiles above
    the causal diagonal cost nothing). full_end is a multiple of BLOCK_N.
    """
    full_end = N // BLOCK_N * BLOCK_N
    end = N
    if CAUSAL:
        diag = N - M
        # The tile's first row sees keys <= start_m + diag, its last row keys <= start_m + BLOCK_M - 1 + diag.
        end = tl.maximum(tl.minimum(N, start_m + BLOCK_M + diag), 0)
        full_end = tl.minimum(full_end, tl.maximum(start_m + diag + 1, 0) // BLOCK_N * BLOCK_N)
    return full_end, end


@triton.jit
def _forward_tiles(
    acc, l_i, m_i,  # (BLOCK_M, BLOCK_D) fp32 output accumulator, (BLOCK_M,) running sum and max (log2)
    q,  # (BLOCK_M, BLOCK_D) query tile
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m,  # (BLOCK_M,) query rows
    start, stop,  # key range to visit, start a multiple of BLOCK_N
    N, diag,  # number of keys; N - M (causal diagonal offset)
    qk_scale,  # scale * log2(e): scores in log2 units
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, N, MASKED,
                       HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, N, MASKED,
                       HEAD_DIM, BLOCK_D)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if MASKED:
            visible = offs_n[None, :] < N
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA + one exp2 per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)  # accumulates in place
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_forward_kernel(
    Q, K, V,  # (Z, H, M, D), (Z, Hkv, N, D), (Z, Hkv, N, D); any strides
    Out,  # (Z, H, M, D) output, contiguous
    LSE,  # (Z, H, M) fp32 logsumexp of the scaled scores (natural log), contiguous
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    H,  # query heads
    GROUP,  # H // Hkv: query heads per key/value head
    M, N,  # query and key lengths
    sm_scale,  # c, the scale of the scores
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, batch x head); grid (cdiv(M, BLOCK_M), Z * H).

    Query tiles run last-first: under a causal mask the last tiles see the most keys, and
    starting the longest programs first keeps the GPU busy to the end of the grid.
    """
    qk_scale = tl.cast(sm_scale, tl.float32) * LOG2E  # scores in log2 units; fp64 under torch.compile
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_zh = tl.program_id(1)
    z = (pid_zh // H).to(tl.int64)
    h = (pid_zh % H).to(tl.int64)
    hkv = h // GROUP
    q_base = Q + z * stride_qz + h * stride_qh
    k_base = K + z * stride_kz + hkv * stride_kh
    v_base = V + z * stride_vz + hkv * stride_vh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, M, True,
                   HEAD_DIM, BLOCK_D)  # fmt: skip

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), RUNNING_MAX_START, dtype=tl.float32)
    diag = N - M
    full_end, end = _key_range(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, 0, full_end, N, diag, qk_scale,
                                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)  # fmt: skip
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, full_end, end, N, diag, qk_scale,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)  # fmt: skip

    empty = l_i == 0.0  # rows that see no key (causal, M > N): output 0, L = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    rows = pid_zh.to(tl.int64) * M + offs_m
    _store_tile(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty), offs_m, M, HEAD_DIM,
                BLOCK_D)  # fmt: skip
    tl.store(LSE + rows, lse, mask=offs_m < M)


@triton.jit
def _dkdv_tiles(
    dk, dv,  # (BLOCK_N, BLOCK_D) fp32 accumulators
    k, v,  # (BLOCK_N, BLOCK_D) key and value tile
    q_base, do_base, lse_base, delta_base,  # this query head's Q, dO, L, Dlt
    stride_qm, stride_qd, stride_dm, stride_dd,
    offs_n,  # (BLOCK_N,) key rows
    start, stop,  # query range to visit, start a multiple of BLOCK_M
    M, diag, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulate dK (unscaled) and dV of one key tile over query tiles; works on transposed scores
    (keys x queries) so no tile is transposed in registers."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in range(start, stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, M, MASKED,
                       HEAD_DIM, BLOCK_D)  # fmt: skip
        do = _load_tile(do_base + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd, offs_m, M, MASKED,
                        HEAD_DIM, BLOCK_D)  # fmt: skip
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=offs_m < M, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < M, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            # where, not a multiply: rows with no visible key have L = -inf and p = inf there.
            visible = offs_m[None, :] < M
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag)
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, K, V, DO,  # as in the forward; DO (Z, H, M, D) like Q, any strides
    LSE,  # (Z, H, M) fp32 L of the forward, contiguous
    DELTA,  # (Z, H, M) fp32 Dlt = rowsum(dO * O), contiguous, stored by the dQ kernel launched before
    DK, DV,  # (Z, Hkv, N, D) out, contiguous
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    HKV, GROUP, M, N,
    sm_scale,  # c
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (key tile, batch x kv head); grid (cdiv(N, BLOCK_N), Z * Hkv).

    Loops over the GROUP query heads sharing this key/value head and, for each, over the query
    tiles that see the key tile: masked tiles along the causal diagonal, whole tiles below it,
    then the partial last query tile. Writes dK and dV once, no atomics. Per program it reads
    its K and V tiles once and, per query head, Q, dO, L and Dlt once.
    """
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under torch.compile
    qk_scale = sm_scale * LOG2E
    pid_n = tl.program_id(0)
    pid_zk = tl.program_id(1)
    z = (pid_zk // HKV).to(tl.int64)
    hkv = (pid_zk % HKV).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + z * stride_kz + hkv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, N, True, HEAD_DIM, BLOCK_D)  # fmt: skip
    v = _load_tile(V + z * stride_vz + hkv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, N, True, HEAD_DIM, BLOCK_D)  # fmt: skip
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    diag = N - M
    full_m = M // BLOCK_M * BLOCK_M  # query tiles below this are whole
    start = 0
    full_start = 0
    if CAUSAL:
        # Row i sees the tile's first key once i >= start_n - diag and all of it once
        # i >= start_n + BLOCK_N - 1 - diag.
        start = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        full_start = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M,
                                tl.cdiv(M, BLOCK_M) * BLOCK_M)  # fmt: skip
        full_start = tl.maximum(full_start, start)
    tail_start = tl.maximum(full_start, full_m)

    for g in range(0, GROUP):
        h = hkv * GROUP + g
        q_base = Q + z * stride_qz + h * stride_qh
        do_base = DO + z * stride_dz + h * stride_dh
        row_base = (z * HKV * GROUP + h) * M
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, start, full_start, M, diag, qk_scale,
                             True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, full_start, full_m, M, diag, qk_scale,
                             False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, tail_start, M, M, diag, qk_scale,
                             True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION)  # fmt: skip

    out = pid_zk.to(tl.int64) * N * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    _store_tile(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), offs_n, N, HEAD_DIM, BLOCK_D)
    _store_tile(DV + out, dv.to(DV.dtype.element_ty), offs_n, N, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_tiles(
    dq,  # (BLOCK_M, BLOCK_D) fp32 accumulator
    q, do, lse2, delta,  # query tile, its dO tile, (BLOCK_M,) L in log2 units, (BLOCK_M,) Dlt
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, start, stop, N, diag, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, N, MASKED,
                       HEAD_DIM, BLOCK_D)  # fmt: skip
        v = _load_tile(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, N, MASKED,
                       HEAD_DIM, BLOCK_D)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            visible = offs_n[None, :] < N
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _flash_backward_dq_kernel(
    Q, K, V,  # as in the forward
    Out,  # (Z, H, M, D) output of the forward, contiguous
    DO,  # (Z, H, M, D) its gradient, any strides
    LSE,  # (Z, H, M) fp32 L of the forward, contiguous
    DELTA,  # (Z, H, M) fp32 out: Dlt = rowsum(dO * O), contiguous, for the dK/dV kernel launched next
    DQ,  # (Z, H, M, D) out, contiguous
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    H, GROUP, M, N,
    sm_scale,  # c
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, batch x head), same key loop as the forward; grid
    (cdiv(M, BLOCK_M), Z * H), longest programs first.

    The first kernel of the backward: every query row belongs to one program, which forms Dlt
    for its rows from the dO tile it needs anyway and the O tile (read once, not kept), uses it
    for dS and stores it for the dK/dV kernel.
    """
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under torch.compile
    qk_scale = sm_scale * LOG2E
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_zh = tl.program_id(1)
    z = (pid_zh // H).to(tl.int64)
    h = (pid_zh % H).to(tl.int64)
    hkv = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + z * stride_qz + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, M, True, HEAD_DIM, BLOCK_D)  # fmt: skip
    do = _load_tile(DO + z * stride_dz + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                    offs_m, M, True, HEAD_DIM, BLOCK_D)  # fmt: skip
    rows = pid_zh.to(tl.int64) * M + offs_m
    o = _load_tile(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], offs_m, M, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past M: 0
    tl.store(DELTA + rows, delta, mask=offs_m < M)
    lse2 = tl.load(LSE + rows, mask=offs_m < M, other=0.0) * LOG2E
    k_base = K + z * stride_kz + hkv * stride_kh
    v_base = V + z * stride_vz + hkv * stride_vh

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    diag = N - M
    full_end, end = _key_range(start_m, M, N, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, 0, full_end, N, diag, qk_scale,
                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)  # fmt: skip
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, full_end, end, N, diag, qk_scale,
                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION)  # fmt: skip
    out = rows[:, None] * HEAD_DIM + offs_d[None, :]
    _store_tile(DQ + out, (dq * sm_scale).to(DQ.dtype.element_ty), offs_m, M, HEAD_DIM, BLOCK_D)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionTiles:
    """How one kernel covers the (queries x keys) plane."""

    block_m: int  # query rows per tile: a program's tile (forward, dQ) or the dK/dV loop's step
    block_n: int  # key rows per tile: the forward / dQ loop's step, or the dK/dV program's tile
    num_warps: int  # warps per program
    num_stages: int  # software-pipelining depth of the tile loop (shared-memory buffers)


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the three kernels for one (GPU architecture, dtype, head dim)."""

    forward: AttentionTiles  # _flash_forward_kernel
    dkdv: AttentionTiles  # _flash_backward_dkdv_kernel
    dq: AttentionTiles  # _flash_backward_dq_kernel (which also forms Dlt)


def _entry(forward: tuple, dkdv: tuple, dq: tuple) -> AttentionConfig:
    """A table entry from each kernel's (block_m, block_n, num_warps, num_stages)."""
    return AttentionConfig(AttentionTiles(*forward), AttentionTiles(*dkdv), AttentionTiles(*dq))


# sm90 (H100 / H200), by (padded head dim, bytes per element), each kernel's tiles as (BLOCK_M,
# BLOCK_N, warps, stages). bf16/fp16 at head dims 64 and 128 and the fp32 forward are the fastest
# measured by benchmarks/tune_attention.py on an H200 (B=8, H=16, N=4096, causal;
# benchmarks/results/attention_tuning_h200.jsonl); dQ shares the dK/dV tiles except where that sweep
# found better ones (bf16/fp16, head dim <= 128). The other entries are scaled from them to fit
# registers and shared memory, and are checked by the GPU tests, not tuned.
SM90_TILES = {
    (16, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (32, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (64, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (128, 2): _entry((128, 128, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3)),
    (256, 2): _entry((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1)),
    (16, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (32, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (64, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (128, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (256, 4): _entry((32, 32, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)),
}
# Sequences of at most SHORT_SEQ keys. There the grid is short (at 4 x 12 heads x 512 tokens the
# long-sequence dQ tiles make 192 programs for 132 SMs) and each program's loop a few steps, so
# smaller backward tiles win: the fastest measured by benchmarks/tune_attention.py on an H100 at
# the presets' shapes, 4 x 12 and 16 x 25 heads x 512 tokens, head dim 64 (both shapes picked the
# same dK/dV and dQ tiles; benchmarks/results/attention_tuning_h100.jsonl). Entries it lacks fall
# back to SM90_TILES.
SHORT_SEQ = 1024
SM90_SHORT_TILES = {
    (64, 2): _entry((64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)),
}
# Tables by compute capability, (long, short). Other GPUs, and 0 (the interpreter, where tiles only
# set which masking paths the tests exercise), take the sm90 tiles: no other architecture was measured.
TILES_BY_ARCH = {90: (SM90_TILES, SM90_SHORT_TILES)}


@functools.cache
def _block_d(head_dim: int) -> int:
    """Head dim padded to a power of two of at least 16, the smallest `tl.dot` operand."""
    return max(16, next_power_of_2(head_dim))


def attention_config(arch: int, dtype: torch.dtype, head_dim: int, keys: int | None = None) -> AttentionConfig:
    """The tiles for a GPU of compute capability ``arch`` (``device_arch``), inputs of ``dtype``, a
    head dim in [1, MAX_HEAD_DIM] and ``keys`` keys per head (None: long sequences). One comparison
    and a cached lookup per call; with a symbolic ``keys`` (a trace with dynamic shapes) the
    comparison becomes a guard on ``keys <= SHORT_SEQ``."""
    return _table_config(arch, dtype, _block_d(head_dim), keys is not None and keys <= SHORT_SEQ)


@functools.cache
def _table_config(arch: int, dtype: torch.dtype, block_d: int, short: bool) -> AttentionConfig:
    long_tiles, short_tiles = TILES_BY_ARCH.get(arch, TILES_BY_ARCH[90])
    key = (block_d, min(dtype.itemsize, 4))
    return short_tiles.get(key, long_tiles[key]) if short else long_tiles[key]


# ----------------------------------------------------------------------------------------------
# Launchers: q (Z, H, M, D) and k, v (Z, Hkv, N, D), or 3-D (Z, M, D), (Z, N, D) read as one head
# (head stride 0), any strides. Eager calls launch through eager_kernel; inside the triton_ops
# (``traced``) Inductor launches the kernels named in wrap_triton from its own code.
# ----------------------------------------------------------------------------------------------


def _dims(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(Z, heads, rows, D) of a 4-D tensor; a 3-D one is a single head."""
    shape = t.shape
    return (shape[0], 1, shape[1], shape[2]) if len(shape) == 3 else shape


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides of ``_dims(t)``."""
    stride = t.stride()
    return (stride[0], 0, stride[1], stride[2]) if len(stride) == 3 else stride


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's matmul setting: TF32 only when the user allowed it."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _launch_forward(q, k, v, causal: bool, scale: float, config: AttentionConfig | None = None, traced: bool = False):
    """-> O (q's shape and dtype, contiguous), L (q.shape[:-1], fp32, contiguous); ``config`` None
    picks ``attention_config``."""
    Z, H, M, D = _dims(q)
    _, Hkv, N, _ = _dims(k)
    D = int(D)  # a constexpr of the kernels (and a config key): specialized in a trace with dynamic shapes
    o = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    if Z * H * M == 0:
        return o, lse
    if N == 0:  # no keys at all: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    if config is None:
        config = attention_config(device_arch(q.device), q.dtype, D, N)
    tiles = config.forward
    kernel = wrap_triton(_flash_forward_kernel) if traced else eager_kernel(_flash_forward_kernel)
    kernel[(cdiv(M, tiles.block_m), Z * H)](
        q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), H, H // Hkv, M, N, scale,
        CAUSAL=causal, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        PRECISION=_precision(q.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return o, lse


def _launch_backward(grad_out, q, k, v, o, lse, causal: bool, scale: float, config: AttentionConfig | None = None,
                     traced: bool = False):  # fmt: skip
    """Gradients (dq, dk, dv), contiguous, in the inputs' dtype, from the forward's O and L (both
    contiguous, as the forward makes them). Two launches: dQ (which stores Dlt), then dK/dV."""
    Z, H, M, D = _dims(q)
    _, Hkv, N, _ = _dims(k)
    D = int(D)  # as in _launch_forward
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if Z * H * M == 0 or N == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if config is None:
        config = attention_config(device_arch(q.device), q.dtype, D, N)
    delta = lse.new_empty(lse.shape)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))  # both kernels take these
    common = dict(CAUSAL=causal, HEAD_DIM=D, BLOCK_D=_block_d(D), PRECISION=_precision(q.dtype))
    tiles = config.dq
    kernel = wrap_triton(_flash_backward_dq_kernel) if traced else eager_kernel(_flash_backward_dq_kernel)
    kernel[(cdiv(M, tiles.block_m), Z * H)](
        q, k, v, o, grad_out, lse, delta, dq, *strides, H, H // Hkv, M, N, scale,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **common,
    )  # fmt: skip
    tiles = config.dkdv
    kernel = wrap_triton(_flash_backward_dkdv_kernel) if traced else eager_kernel(_flash_backward_dkdv_kernel)
    kernel[(cdiv(N, tiles.block_n), Z * Hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, *strides, Hkv, H // Hkv, M, N, scale,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **common,
    )  # fmt: skip
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# The algorithm in plain PyTorch (FlashAttentionTorch): same tiling and online softmax as the
# kernels, fp32 accumulation, runs anywhere. Slow (Python loops over tiles); for reading,
# debugging, and the CPU reference path. Same contract as the launchers, the tile edge in place
# of their config.
# ----------------------------------------------------------------------------------------------


def _as_4d(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(B, N, D) -> (B, 1, N, D) views; 4-D tensors pass through."""
    return [t.unsqueeze(1) if t.dim() == 3 else t for t in tensors]


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(Z, Hkv, N, D) -> (Z, H, N, D): key/value head h // (H // Hkv) for query head h (Hkv = 0
    comes with H = 0: nothing to expand)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] else t


def _reduce_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(Z, H, N, D) per-query-head gradient -> (Z, Hkv, N, D) summed over each group."""
    Z, H, N, D = grad.shape
    return grad.view(Z, kv_heads, H // kv_heads, N, D).sum(2) if kv_heads else grad


def _visible(rows: torch.Tensor, cols: torch.Tensor, diag: int) -> torch.Tensor:
    """(rows, cols) bool: query row i sees key j iff j <= i + diag (bottom-right aligned)."""
    return cols[None, :] <= rows[:, None] + diag


def _tiled_forward(q, k, v, causal: bool, scale: float, tile: int = TORCH_TILE):
    if q.dim() == 3:
        o, lse = _tiled_forward(*_as_4d(q, k, v), causal, scale, tile)
        return o.squeeze(1), lse.squeeze(1)
    Z, H, M, D = q.shape
    N = k.shape[2]
    k, v = _expand_kv(k, H).float(), _expand_kv(v, H).float()
    o = torch.zeros((Z, H, M, D), device=q.device, dtype=torch.float32)
    lse = torch.full((Z, H, M), float("-inf"), device=q.device, dtype=torch.float32)
    diag = N - M
    for m0 in range(0, M, tile):
        last_row = min(m0 + tile, M) - 1
        rows = torch.arange(m0, last_row + 1, device=q.device)
        qi = q[:, :, m0 : m0 + tile].float()
        m_i = torch.full((Z, H, len(rows)), float("-inf"), device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(qi)
        for n0 in range(0, N, tile):
            if causal and n0 > last_row + diag:
                break  # this and all later key tiles lie above the diagonal: skipped
            cols = torch.arange(n0, min(n0 + tile, N), device=q.device)
            s = qi @ k[:, :, n0 : n0 + tile].transpose(-1, -2) * scale
            if causal:
                s = s.masked_fill(~_visible(rows, cols, diag), float("-inf"))
            m_new = torch.maximum(m_i, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m_i - m_safe)
            l_i = alpha * l_i + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v[:, :, n0 : n0 + tile]
            m_i = m_new
        empty = l_i == 0
        o[:, :, m0 : m0 + tile] = acc / torch.where(empty, 1.0, l_i)[..., None]
        lse[:, :, m0 : m0 + tile] = torch.where(empty, float("-inf"), m_i + torch.log(l_i))
    return o.to(q.dtype), lse


def _tiled_backward(grad_out, q, k, v, o, lse, causal: bool, scale: float, tile: int = TORCH_TILE):
    if q.dim() == 3:
        grads = _tiled_backward(*_as_4d(grad_out, q, k, v, o), lse.unsqueeze(1), causal, scale, tile)
        return tuple(g.squeeze(1) for g in grads)
    Z, H, M, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    qf, dof = q.float(), grad_out.float()
    kf, vf = _expand_kv(k, H).float(), _expand_kv(v, H).float()
    delta = (dof * o.float()).sum(-1)  # Dlt = rowsum(dO * O), (Z, H, M)
    lse_safe = torch.where(lse == float("-inf"), 0.0, lse)  # empty rows: every score is masked
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    diag = N - M
    for m0 in range(0, M, tile):
        last_row = min(m0 + tile, M) - 1
        rows = torch.arange(m0, last_row + 1, device=q.device)
        qi, doi = qf[:, :, m0 : m0 + tile], dof[:, :, m0 : m0 + tile]
        for n0 in range(0, N, tile):
            if causal and n0 > last_row + diag:
                break
            cols = torch.arange(n0, min(n0 + tile, N), device=q.device)
            kj, vj = kf[:, :, n0 : n0 + tile], vf[:, :, n0 : n0 + tile]
            s = qi @ kj.transpose(-1, -2) * scale
            if causal:
                s = s.masked_fill(~_visible(rows, cols, diag), float("-inf"))
            p = torch.exp(s - lse_safe[:, :, m0 : m0 + tile, None])
            dv[:, :, n0 : n0 + tile] += p.transpose(-1, -2) @ doi
            dp = doi @ vj.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0 : m0 + tile, None])
            dq[:, :, m0 : m0 + tile] += ds @ kj * scale
            dk[:, :, n0 : n0 + tile] += ds.transpose(-1, -2) @ qi * scale
    dk, dv = _reduce_groups(dk, Hkv), _reduce_groups(dv, Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------
# torch.library ops (traced), autograd.Functions (eager)
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) for q (Z, H, M, D) or (Z, M, D), k/v (Z, Hkv, N, D) or (Z, N, D): the kernels or,
    off the Triton path, the tiled twin."""
    if runs_triton(q):
        return _launch_forward(q, k, v, causal, scale, traced=True)
    return _tiled_forward(q, k, v, causal, scale)


@torch.library.triton_op("fastlm::flash_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if runs_triton(q):  # O and L as the op's caller passes them: the kernels index them as contiguous
        return _launch_backward(grad_out, q, k, v, o.contiguous(), lse.contiguous(), causal, scale, traced=True)
    return _tiled_backward(grad_out, q, k, v, o, lse, causal, scale)


def _op_setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(lse, q, k, v, o)
    ctx.options = (causal, scale)


def _op_backward(ctx, grad_out, _grad_lse):
    lse, q, k, v, o = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, o, lse, *ctx.options)
    return dq, dk, dv, None, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


def _autograd_forward(ctx, forward, q, k, v, causal: bool, scale: float, config):
    """Shared forward of the autograd.Functions (``config``: the kernels' AttentionConfig or the
    twin's tile edge): saves exactly (L, Q, K, V, O), and what the backward needs besides, so
    that it recomputes nothing."""
    o, lse = forward(q, k, v, causal, scale, config)
    ctx.save_for_backward(lse, q, k, v, o)
    ctx.options = (causal, scale, config)
    return o


def _autograd_backward(ctx, backward, grad_out):
    lse, q, k, v, o = ctx.saved_tensors
    dq, dk, dv = backward(grad_out, q, k, v, o, lse, *ctx.options)
    return dq, dk, dv, None, None, None


class _FlashAttentionKernels(torch.autograd.Function):
    """The Triton kernels for inputs already checked: ``apply(q, k, v, causal, scale, config)``
    with a bool, a float and an AttentionConfig or None (picked for q). ``flash_attention``'s
    eager path."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config):
        if config is None:  # picked here, not in the launcher: the backward reuses it
            config = attention_config(device_arch(q.device), q.dtype, q.shape[-1], k.shape[-2])
        return _autograd_forward(ctx, _launch_forward, q, k, v, causal, scale, config)

    @staticmethod
    def backward(ctx, grad_out):
        return _autograd_backward(ctx, _launch_backward, grad_out)


class _FlashAttentionTiled(torch.autograd.Function):
    """The tiled twin for inputs already checked: ``apply(q, k, v, causal, scale, tile)``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, tile):
        return _autograd_forward(ctx, _tiled_forward, q, k, v, causal, scale, tile)

    @staticmethod
    def backward(ctx, grad_out):
        return _autograd_backward(ctx, _tiled_backward, grad_out)


class FlashAttentionTorch(_FlashAttentionTiled):
    """FlashAttention-2 tiled in plain PyTorch (tiles of TORCH_TILE, online softmax, backward from
    L and Dlt = rowsum(dO * O)). Runs on any device; the readable version of the kernels.

    ``apply(q, k, v, is_causal=False, scale=None)``; q, k, v as in ``flash_attention``, checked.
    Saves exactly (L, Q, K, V, O), L of shape (B, Nq) or (B, H, Nq) in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None):
        check_inputs(q, k, v)
        scale = default_scale(q.shape[-1], scale)
        return _FlashAttentionTiled.forward(ctx, q, k, v, check_flag("is_causal", is_causal), scale, TORCH_TILE)


class FlashAttentionTriton(_FlashAttentionKernels):
    """FlashAttention-2 in Triton: the fast path. CUDA tensors, or CPU under TRITON_INTERPRET=1.

    ``apply(q, k, v, is_causal=False, scale=None, config=None)``; q, k, v as in ``flash_attention``,
    checked; ``config`` an AttentionConfig (None: ``attention_config`` for q's GPU, dtype, head
    dim and number of keys). Saves exactly (L, Q, K, V, O), L of shape (B, Nq) or (B, H, Nq) in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, config=None):
        if not runs_triton(q):
            raise ValueError(f"FlashAttentionTriton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {q.device}")
        check_inputs(q, k, v)
        scale = default_scale(q.shape[-1], scale)
        return _FlashAttentionKernels.forward(ctx, q, k, v, check_flag("is_causal", is_causal), scale, config)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    """One clear error for each way q, k, v can be wrong; the common case is checked first and cheaply."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, tensor)
    q_shape, k_shape = q.shape, k.shape
    rank = len(q_shape)
    if rank not in (3, 4):
        raise ValueError(f"q must be (B, N, D) or (B, H, N, D), got shape {tuple(q_shape)}")
    if len(k_shape) != rank or v.dim() != rank:
        raise ValueError(
            f"q, k and v must have the same number of dims, got {tuple(q_shape)}, {tuple(k_shape)}, {tuple(v.shape)}"
        )
    if k_shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v.shape)}")
    if q_shape[0] != k_shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q_shape[0]} and {k_shape[0]}")
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q_shape[-1]} and {k_shape[-1]}")
    if not 1 <= q_shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must lie in [1, {MAX_HEAD_DIM}] (the last dim of q, k, v), got {q_shape[-1]}")
    if rank == 4 and (q_shape[1] % k_shape[1] != 0 if k_shape[1] else q_shape[1] != 0):
        raise ValueError(
            f"query heads ({q_shape[1]}) must be a multiple of key/value heads ({k_shape[1]}) "
            "for grouped-query attention"
        )
    device = q.device
    if k.device != device or v.device != device:
        check_same_device(q=q, k=k, v=v)
    dtype = q.dtype
    if dtype not in dtypes or k.dtype != dtype or v.dtype != dtype:
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            check_dtype(name, tensor, dtypes)
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, checked (a finite number > 0), or 1 / sqrt(head_dim) for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_number("scale", scale, positive=True)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q k^T [+ causal mask]) v without materializing the scores.

    Args:
        q: (B, Nq, D) or (B, H, Nq, D).
        k, v: (B, Nk, D) or (B, Hkv, Nk, D); H must be a multiple of Hkv (grouped-query attention).
        causal: query i sees key j iff j <= i + (Nk - Nq) (bottom-right aligned when Nq != Nk);
            query rows that see no key return 0.
        scale: multiplies the scores; defaults to 1 / sqrt(D).

    Returns the output with q's shape and dtype. fp32 inputs use TF32 matmuls only when
    ``torch.backends.cuda.matmul.allow_tf32`` is set, as torch's own matmuls do.
    """
    check_inputs(q, k, v)  # once: the autograd.Functions below take checked inputs
    scale = default_scale(q.shape[-1], scale)
    causal = check_flag("causal", causal)
    if torch.compiler.is_compiling():
        return _forward_op(q, k, v, causal, scale)[0]
    if runs_triton(q):
        return _FlashAttentionKernels.apply(q, k, v, causal, scale, None)
    return _FlashAttentionTiled.apply(q, k, v, causal, scale, TORCH_TILE)


def flash_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Materialized-scores reference with the semantics of ``flash_attention``, in fp32 (fp64 stays
    fp64); returns q's dtype promoted to at least fp32. Costs Nq x Nk memory."""
    check_inputs(q, k, v, dtypes=(*DTYPES, torch.float64))
    scale = default_scale(q.shape[-1], scale)
    compute = torch.promote_types(q.dtype, torch.float32)
    q4, k4, v4 = (t.to(compute) for t in _as_4d(q, k, v))
    k4, v4 = _expand_kv(k4, q4.shape[1]), _expand_kv(v4, q4.shape[1])
    s = q4 @ k4.transpose(-1, -2) * scale
    M, N = q4.shape[2], k4.shape[2]
    if causal:
        rows = torch.arange(M, device=q.device)
        s = s.masked_fill(~_visible(rows, torch.arange(N, device=q.device), N - M), float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(s.isneginf().all(-1, keepdim=True), 0.0)  # no visible key: 0
    out = p @ v4
    return out.squeeze(1) if q.dim() == 3 else out
