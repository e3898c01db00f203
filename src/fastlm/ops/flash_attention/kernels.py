"""FlashAttention-2 kernels in Triton: the forward, and the backward as two launches (dQ, then dK/dV).

Math, per head, with queries Q (M, D), keys K (N, D), values V (N, D) and scale c:

    S = c * Q K^T            P = softmax(S) row-wise         O = P V        L = logsumexp(S) row-wise
    dV = P^T dO              dP = dO V^T                     Dlt = rowsum(dO * O)
    dS = P * (dP - Dlt)      dQ = c * dS K                   dK = c * dS^T Q

FlashAttention-2 (Dao, 2023) never materializes S or P: the forward streams key tiles past a
query tile held on chip, keeping a running max m, running sum l and an fp32 accumulator
(online softmax), and saves only O and L. The backward recomputes P = exp(S - L) tile by tile.

Softcap c (Gemma 2): S = c tanh(scale Q K^T / c) in place of the scaled scores; the backward
recomputes T = tanh(.) and takes dS times 1 - T^2 (the chain factor, its scale applied with the
rest); the same tiles, masks and cost, two more exp2-class operations per score.

Masks (masks.py): query row i sits at position p = i + (N - M) among the keys and sees key j iff
p - left <= j <= p + right, each side bounded or not (BOUNDED_LEFT, BOUNDED_RIGHT); causal is
right = 0. Every program visits only the tiles its rows can see (`_visible_range`): tiles wholly
outside the mask cost nothing, so causal attention costs half of full attention and a window of
w keys costs O(N w) instead of O(N^2); tiles that every row sees whole skip the mask. Rows that see
no key return 0 and have L = -inf. Masked scores are -inf, never NaN.

Packed sequences (VARLEN): documents laid end to end in (total, H, D) tensors, delimited by int32
cumulative lengths cu_seqlens (docs + 1,) as FlashAttention's varlen functions take them. Each
document is a batch entry of its own lengths, and a program loads its document's rows only, so no
tile crosses a boundary. The grid is a flat list of the documents' tiles (`_packed_tile`), not
(tiles of the longest document) x documents: a batch of long-tailed lengths launches about as many
programs as it has tiles.

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

import triton
import triton.language as tl

from fastlm.ops.constants import LN2, LOG2E

# Start value of the running max (log2 units): finite, so exp2(m_old - m_new) is 0, not NaN, while
# every score seen so far is masked.
RUNNING_MAX_START = tl.constexpr(-3.0e38)
# Documents whose first rows a program of a packed grid reads at once to find its tile.
DOC_CHUNK = tl.constexpr(128)


@triton.jit
def _softcapped(s, pre):
    """tanh(x), x = s * pre (no tanh in every Triton's core language): the softcapped scores
    c tanh(S / c) are this times c. Below |x| = 0.1 its series to x^5 (off by under 6e-8 relative),
    where 1 - 2 / (exp2(2 log2(e) x) + 1) would cancel (a wide cap: c tanh(S / c) off by c * 6e-8);
    above, that form, which saturates to +-1 without NaN."""
    x = s * pre
    x2 = x * x
    series = x * (1.0 + x2 * (x2 * (2.0 / 15.0) - 1.0 / 3.0))
    return tl.where(tl.abs(x) < 0.1, series, 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0))


@triton.jit
def _score_scales(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(pre, qk_scale) of the tiles: the raw dot products s become tanh(s * pre) where SOFTCAP, and
    either times qk_scale are the scores in log2 units (softcap c: c tanh(sm_scale s / c) log2(e))."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under torch.compile
    if SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
        return sm_scale / softcap, softcap * LOG2E
    return sm_scale, sm_scale * LOG2E


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
def _packed_tile(slot, CU_SEQLENS, CU_SEQLENS_OTHER, num_docs, BLOCK: tl.constexpr):
    """(z, first, first_other, n_rows, n_other, start) of tile ``slot`` of a packed grid: its
    document, the document's first row and length on each side, and the tile's first row in it.

    Document d's tiles take the slots from T_d = cu_seqlens[d] // BLOCK + d on. T_d increases with
    d and T_{d+1} - T_d >= cdiv(len_d, BLOCK), so total // BLOCK + docs slots hold every tile with
    at most one spare slot per document, and a slot's document is the number of T_d <= slot, minus
    one: a count over the cumulative lengths, DOC_CHUNK at a time, instead of a search. The same
    pass reads the document's bounds on both sides, as cumulative lengths never fall: its first
    rows are the largest bounds among the documents counted, its ends the smallest among the rest
    (d = docs included, whose T_d exceeds every slot). So a program waits for one round of loads
    before its first tile, not two. A spare slot gets a first row >= its document's length.
    """
    count = 0
    first = 0
    first_other = 0
    end = 2147483647
    end_other = 2147483647
    for chunk in range(0, num_docs + 1, DOC_CHUNK):
        docs = chunk + tl.arange(0, DOC_CHUNK)
        inside = docs <= num_docs
        bounds = tl.load(CU_SEQLENS + docs, mask=inside, other=0)
        bounds_other = tl.load(CU_SEQLENS_OTHER + docs, mask=inside, other=0)
        counted = bounds // BLOCK + docs <= slot  # the slot's document and those before it
        later = inside & ~counted
        counted = inside & counted
        count += tl.sum(counted.to(tl.int32), 0)
        first = tl.maximum(first, tl.max(tl.where(counted, bounds, 0), 0))
        first_other = tl.maximum(first_other, tl.max(tl.where(counted, bounds_other, 0), 0))
        end = tl.minimum(end, tl.min(tl.where(later, bounds, 2147483647), 0))
        end_other = tl.minimum(end_other, tl.min(tl.where(later, bounds_other, 2147483647), 0))
    doc = count - 1
    return doc, first, first_other, end - first, end_other - first_other, (slot - first // BLOCK - doc) * BLOCK


@triton.jit
def _locate(
    pid,  # the program's index along the tile axis
    CU_SEQLENS, CU_SEQLENS_OTHER,  # packed: cumulative lengths of the tiled rows and of the other side
    num_docs,  # packed: documents
    n_rows, n_other,  # dense: lengths of the tiled side and of the other
    BLOCK: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Where a program works: (z, first, first_other, n_rows, n_other, start).

    Dense: tile ``pid`` of batch entry z = program_id(2); rows start at 0 on both sides (the batch
    stride separates entries). Packed: the document z and tile of slot ``pid`` (`_packed_tile`), the
    first row of the document on each side and its lengths (the launcher passes batch strides 0).
    ``start`` (the tile's first row) is >= n_rows on a packed grid's spare slots.
    """
    if VARLEN:
        z, first, first_other, n_rows, n_other, start = _packed_tile(pid, CU_SEQLENS, CU_SEQLENS_OTHER, num_docs, BLOCK)
        first, first_other = first.to(tl.int64), first_other.to(tl.int64)
    else:
        z, start = tl.program_id(2), pid * BLOCK
        first, first_other = 0, 0
    return z.to(tl.int64), first, first_other, n_rows, n_other, start


@triton.jit
def _visible_range(
    first, last,  # the tile's first and last row (rows past the tensor's end excluded)
    shift,  # row r's position on the other axis is r + shift
    n_other,  # indices on the other axis
    below, above,  # row r sees r + shift - below .. r + shift + above, where bounded
    BOUNDED_BELOW: tl.constexpr, BOUNDED_ABOVE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The BLOCK-wide tiles of the other axis that rows first..last see: (start, full_start,
    full_end, end). Tiles in [full_start, full_end) are seen whole by every row (no mask needed),
    tiles in [start, full_start) and [full_end, end) in part; everything else is never visited.
    start, full_start and full_end are multiples of BLOCK, and start <= full_start <= full_end.

    Forward and dQ: rows are queries, the other axis keys, shift N - M, (below, above) = (left,
    right). dK/dV: rows are keys, the other axis queries, shift M - N, (below, above) = (right, left).
    """
    start = 0
    full_start = 0
    full_end = n_other // BLOCK * BLOCK
    end = n_other
    if BOUNDED_ABOVE:
        end = tl.minimum(tl.maximum(last + shift + above + 1, 0), n_other)
        full_end = tl.minimum(full_end, tl.maximum(first + shift + above + 1, 0) // BLOCK * BLOCK)
    if BOUNDED_BELOW:
        start = tl.maximum(first + shift - below, 0) // BLOCK * BLOCK
        full_start = tl.maximum(tl.cdiv(tl.maximum(last + shift - below, 0), BLOCK) * BLOCK, start)
        full_start = tl.minimum(full_start, tl.cdiv(end, BLOCK) * BLOCK)
        full_end = tl.maximum(full_end, full_start)
    return start, full_start, full_end, end


@triton.jit
def _forward_tiles(
    acc, l_i, m_i,  # (BLOCK_M, BLOCK_D) fp32 output accumulator, (BLOCK_M,) running sum and max (log2)
    q,  # (BLOCK_M, BLOCK_D) query tile
    k_rows, v_rows,  # pointers to this head's first key / value row, or with TMA their descriptors
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m,  # (BLOCK_M,) query rows
    start, stop,  # key range to visit, start a multiple of BLOCK_N
    N,  # number of keys
    lowest, highest,  # row i sees keys i + lowest .. i + highest (where bounded)
    pre, qk_scale,  # `_score_scales`: scores in log2 units
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:  # rows past N come back as zeros, as the masked pointer loads give them
            k = k_rows.load([start_n, 0])
            v = v_rows.load([start_n, 0])
        else:
            k = _load_tile(
                k_rows + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, N, MASKED, HEAD_DIM, BLOCK_D
            )
            v = _load_tile(
                v_rows + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, N, MASKED, HEAD_DIM, BLOCK_D
            )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if SOFTCAP:  # before the mask: its -inf must stay -inf
            s = _softcapped(s, pre)
        if MASKED:
            visible = offs_n[None, :] < N
            if BOUNDED_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + lowest)
            if BOUNDED_RIGHT:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + highest)
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
    Q, K, V,  # (Z, H, M, D), (Z, Hkv, N, D), (Z, Hkv, N, D), any strides; packed (total_q, H, D), (total_k, Hkv, D)
    Out,  # q's shape, written
    LSE,  # (Z, H, M), packed (H, total_q): fp32 logsumexp of the scaled scores (natural log), written
    CU_SEQLENS_Q, CU_SEQLENS_K,  # packed: (docs + 1,) int32 cumulative lengths; dense: None
    stride_qz, stride_qh, stride_qm, stride_qd,  # packed: batch stride 0, the row stride as stride_qm
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om,  # Out's (unit stride along D)
    stride_lz, stride_lh,  # LSE's (unit stride along rows)
    H,  # query heads
    GROUP,  # H // Hkv: query heads per key/value head
    M, N,  # query and key lengths (packed: unused, each document's come from cu_seqlens)
    num_docs,  # packed: documents (dense: unused)
    sm_scale,  # c, the scale of the scores
    softcap,  # the scores' softcap where SOFTCAP
    window_left, window_right,  # the mask's bounds where BOUNDED_LEFT / BOUNDED_RIGHT
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr,  # HEAD_DIM == BLOCK_D, 16-byte aligned rows (launchers._descriptors_fit)
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch entry); grid (cdiv(M, BLOCK_M), H, Z), packed
    (total_q // BLOCK_M + docs, H, 1).

    Query tiles run last-first: under a causal mask the last tiles see the most keys, and
    starting the longest programs first keeps the GPU busy to the end of the grid.

    TMA: Q, K, V and O move through tensor descriptors that each program makes over its head's
    (rows, D) rows, packed: its document's (Hopper's TMA engine; the descriptors live in a global
    scratch of 128 bytes each per program) instead of pointer tiles; the same arithmetic. Rows past
    the descriptor's end load as zeros and are not stored, so no tile reads or writes another
    document's rows. Faster at D=128 on sm90 (docs/notes/attention.md, section 15), slower at D=64,
    so the tile tables choose it.
    """
    pre, qk_scale = _score_scales(sm_scale, softcap, SOFTCAP)
    z, q0, k0, M, N, start_m = _locate(
        tl.num_programs(0) - 1 - tl.program_id(0), CU_SEQLENS_Q, CU_SEQLENS_K, num_docs, M, N, BLOCK_M, VARLEN
    )
    if VARLEN:
        if start_m >= M:  # a spare slot
            return
    h = tl.program_id(1).to(tl.int64)
    hkv = h // GROUP
    q_base = Q + z * stride_qz + h * stride_qh + q0 * stride_qm
    k_base = K + z * stride_kz + hkv * stride_kh + k0 * stride_kn
    v_base = V + z * stride_vz + hkv * stride_vh + k0 * stride_vn

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if TMA:  # descriptors of (base, shape, strides, block shape)
        q = tl.make_tensor_descriptor(q_base, [M, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM]).load([start_m, 0])
        k_rows = tl.make_tensor_descriptor(k_base, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM])
        v_rows = tl.make_tensor_descriptor(v_base, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM])
    else:
        q = _load_tile(
            q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, M, True, HEAD_DIM, BLOCK_D
        )
        k_rows, v_rows = k_base, v_base

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), RUNNING_MAX_START, dtype=tl.float32)
    diag = N - M
    lowest, highest = diag - window_left, diag + window_right
    start, full_start, full_end, end = _visible_range(
        start_m,
        tl.minimum(start_m + BLOCK_M, M) - 1,
        diag,
        N,
        window_left,
        window_right,
        BOUNDED_LEFT,
        BOUNDED_RIGHT,
        BLOCK_N,
    )
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_rows, v_rows, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, start, full_start, N, lowest, highest, pre, qk_scale,
                                   True, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   PRECISION, TMA, SOFTCAP)  # fmt: skip
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_rows, v_rows, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, full_start, full_end, N, lowest, highest, pre, qk_scale,
                                   False, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   PRECISION, TMA, SOFTCAP)  # fmt: skip
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_rows, v_rows, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, full_end, end, N, lowest, highest, pre, qk_scale,
                                   True, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   PRECISION, TMA, SOFTCAP)  # fmt: skip

    empty = l_i == 0.0  # rows that see no key: output 0, L = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_base = Out + z * stride_oz + h * stride_oh + q0 * stride_om
    if TMA:  # rows past M are clipped
        desc_o = tl.make_tensor_descriptor(o_base, [M, HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM])
        desc_o.store([start_m, 0], acc.to(Out.dtype.element_ty))
    else:
        _store_tile(
            o_base + offs_m[:, None] * stride_om + offs_d[None, :],
            acc.to(Out.dtype.element_ty),
            offs_m,
            M,
            HEAD_DIM,
            BLOCK_D,
        )
    tl.store(LSE + z * stride_lz + h * stride_lh + q0 + offs_m, lse, mask=offs_m < M)


@triton.jit
def _dkdv_tiles(
    dk, dv,  # (BLOCK_N, BLOCK_D) fp32 accumulators
    k, v,  # (BLOCK_N, BLOCK_D) key and value tile
    q_base, do_base, lse_base, delta_base,  # this query head's Q, dO, L, Dlt
    stride_qm, stride_qd, stride_dm, stride_dd,
    offs_n,  # (BLOCK_N,) key rows
    start, stop,  # query range to visit, start a multiple of BLOCK_M
    M, lowest, highest, pre, qk_scale,  # as in _forward_tiles: query i sees keys i + lowest .. i + highest
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Accumulate dK (unscaled) and dV of one key tile over query tiles; works on transposed scores
    (keys x queries) so no tile is transposed in registers."""
    offs_d = tl.arange(0, BLOCK_D)
    for start_m in range(start, stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(
            q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, M, MASKED, HEAD_DIM, BLOCK_D
        )
        do = _load_tile(
            do_base + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd, offs_m, M, MASKED, HEAD_DIM, BLOCK_D
        )
        if MASKED:
            lse = tl.load(lse_base + offs_m, mask=offs_m < M, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < M, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            s_t = _softcapped(s_t, pre)
        p_t = tl.math.exp2(s_t * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            # where, not a multiply: rows with no visible key have L = -inf and p = inf there.
            visible = offs_m[None, :] < M
            if BOUNDED_LEFT:
                visible = visible & (offs_n[:, None] >= offs_m[None, :] + lowest)
            if BOUNDED_RIGHT:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + highest)
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - s_t * s_t)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, K, V, DO,  # as in the forward; DO like Q, any strides
    LSE,  # L of the forward, fp32, LSE's layout in the forward
    DELTA,  # Dlt = rowsum(dO * O), fp32, laid out as LSE, stored by the dQ kernel launched before
    DK, DV,  # k's shape, written
    CU_SEQLENS_Q, CU_SEQLENS_K,  # as in the forward
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    stride_gz, stride_gh, stride_gn,  # DK's and DV's (unit stride along D)
    stride_lz, stride_lh,  # LSE's and DELTA's
    HKV, GROUP, M, N, num_docs,
    sm_scale,  # c
    softcap,  # as in the forward
    window_left, window_right,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per (key tile, kv head, batch entry); grid (cdiv(N, BLOCK_N), Hkv, Z), packed
    (total_k // BLOCK_N + docs, Hkv, 1).

    Loops over the GROUP query heads sharing this key/value head and, for each, over the query
    tiles that see the key tile: tiles that see it in part (masked), then whole, then in part.
    Writes dK and dV once, no atomics. Per program it reads its K and V tiles once and, per query
    head, Q, dO, L and Dlt once.
    """
    pre, qk_scale = _score_scales(sm_scale, softcap, SOFTCAP)
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under torch.compile
    z, k0, q0, N, M, start_n = _locate(tl.program_id(0), CU_SEQLENS_K, CU_SEQLENS_Q, num_docs, N, M, BLOCK_N, VARLEN)
    if VARLEN:
        if start_n >= N:  # a spare slot
            return
    hkv = tl.program_id(1).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + z * stride_kz + hkv * stride_kh + k0 * stride_kn
    v_base = V + z * stride_vz + hkv * stride_vh + k0 * stride_vn
    k = _load_tile(
        k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, N, True, HEAD_DIM, BLOCK_D
    )
    v = _load_tile(
        v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, N, True, HEAD_DIM, BLOCK_D
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    diag = N - M
    lowest, highest = diag - window_left, diag + window_right
    start, full_start, full_end, end = _visible_range(
        start_n,
        tl.minimum(start_n + BLOCK_N, N) - 1,
        -diag,
        M,
        window_right,
        window_left,
        BOUNDED_RIGHT,
        BOUNDED_LEFT,
        BLOCK_M,
    )
    for g in range(0, GROUP):
        h = hkv * GROUP + g
        q_base = Q + z * stride_qz + h * stride_qh + q0 * stride_qm
        do_base = DO + z * stride_dz + h * stride_dh + q0 * stride_dm
        row_base = z * stride_lz + h * stride_lh + q0
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, start, full_start,
                             M, lowest, highest, pre, qk_scale, True, BOUNDED_LEFT, BOUNDED_RIGHT,
                             HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION, SOFTCAP)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, full_start, full_end,
                             M, lowest, highest, pre, qk_scale, False, BOUNDED_LEFT, BOUNDED_RIGHT,
                             HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION, SOFTCAP)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, LSE + row_base, DELTA + row_base,
                             stride_qm, stride_qd, stride_dm, stride_dd, offs_n, full_end, end,
                             M, lowest, highest, pre, qk_scale, True, BOUNDED_LEFT, BOUNDED_RIGHT,
                             HEAD_DIM, BLOCK_D, BLOCK_M, PRECISION, SOFTCAP)  # fmt: skip

    out = z * stride_gz + hkv * stride_gh + k0 * stride_gn + offs_n[:, None] * stride_gn + offs_d[None, :]
    _store_tile(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), offs_n, N, HEAD_DIM, BLOCK_D)
    _store_tile(DV + out, dv.to(DV.dtype.element_ty), offs_n, N, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_tiles(
    dq,  # (BLOCK_M, BLOCK_D) fp32 accumulator
    q, do, lse2, delta,  # query tile, its dO tile, (BLOCK_M,) L in log2 units, (BLOCK_M,) Dlt
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, start, stop, N, lowest, highest, pre, qk_scale,  # as in _forward_tiles
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(
            k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, N, MASKED, HEAD_DIM, BLOCK_D
        )
        v = _load_tile(
            v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, N, MASKED, HEAD_DIM, BLOCK_D
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP:
            s = _softcapped(s, pre)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            visible = offs_n[None, :] < N
            if BOUNDED_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + lowest)
            if BOUNDED_RIGHT:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + highest)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - s * s)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _flash_backward_dq_kernel(
    Q, K, V,  # as in the forward
    Out,  # output of the forward, q's shape, unit stride along D
    DO,  # its gradient, q's shape, any strides
    LSE,  # L of the forward, fp32, LSE's layout in the forward
    DELTA,  # Dlt = rowsum(dO * O), fp32, laid out as LSE, written for the dK/dV kernel launched next
    DQ,  # q's shape, written
    CU_SEQLENS_Q, CU_SEQLENS_K,  # as in the forward
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_dz, stride_dh, stride_dm, stride_dd,
    stride_oz, stride_oh, stride_om,  # Out's (unit stride along D)
    stride_gz, stride_gh, stride_gm,  # DQ's (unit stride along D)
    stride_lz, stride_lh,  # LSE's and DELTA's
    H, GROUP, M, N, num_docs,
    sm_scale,  # c
    softcap,  # as in the forward
    window_left, window_right,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, VARLEN: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per (query tile, head, batch entry), same grid and key loop as the forward,
    longest programs first.

    The first kernel of the backward: every query row belongs to one program, which forms Dlt
    for its rows from the dO tile it needs anyway and the O tile (read once, not kept), uses it
    for dS and stores it for the dK/dV kernel.
    """
    pre, qk_scale = _score_scales(sm_scale, softcap, SOFTCAP)
    sm_scale = tl.cast(sm_scale, tl.float32)  # fp64 under torch.compile
    z, q0, k0, M, N, start_m = _locate(
        tl.num_programs(0) - 1 - tl.program_id(0), CU_SEQLENS_Q, CU_SEQLENS_K, num_docs, M, N, BLOCK_M, VARLEN
    )
    if VARLEN:
        if start_m >= M:  # a spare slot
            return
    h = tl.program_id(1).to(tl.int64)
    hkv = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + z * stride_qz + h * stride_qh + q0 * stride_qm
    do_base = DO + z * stride_dz + h * stride_dh + q0 * stride_dm
    q = _load_tile(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, M, True, HEAD_DIM, BLOCK_D
    )
    do = _load_tile(
        do_base + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd, offs_m, M, True, HEAD_DIM, BLOCK_D
    )
    out = z * stride_oz + h * stride_oh + q0 * stride_om + offs_m[:, None] * stride_om + offs_d[None, :]
    o = _load_tile(Out + out, offs_m, M, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past M: 0
    lse_rows = z * stride_lz + h * stride_lh + q0 + offs_m
    tl.store(DELTA + lse_rows, delta, mask=offs_m < M)
    lse2 = tl.load(LSE + lse_rows, mask=offs_m < M, other=0.0) * LOG2E
    k_base = K + z * stride_kz + hkv * stride_kh + k0 * stride_kn
    v_base = V + z * stride_vz + hkv * stride_vh + k0 * stride_vn

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    diag = N - M
    lowest, highest = diag - window_left, diag + window_right
    start, full_start, full_end, end = _visible_range(
        start_m,
        tl.minimum(start_m + BLOCK_M, M) - 1,
        diag,
        N,
        window_left,
        window_right,
        BOUNDED_LEFT,
        BOUNDED_RIGHT,
        BLOCK_N,
    )
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, start, full_start, N, lowest, highest, pre, qk_scale,
                   True, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, SOFTCAP)  # fmt: skip
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, full_start, full_end, N, lowest, highest, pre, qk_scale,
                   False, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, SOFTCAP)  # fmt: skip
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, full_end, end, N, lowest, highest, pre, qk_scale,
                   True, BOUNDED_LEFT, BOUNDED_RIGHT, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, SOFTCAP)  # fmt: skip
    grad = z * stride_gz + h * stride_gh + q0 * stride_gm + offs_m[:, None] * stride_gm + offs_d[None, :]
    _store_tile(DQ + grad, (dq * sm_scale).to(DQ.dtype.element_ty), offs_m, M, HEAD_DIM, BLOCK_D)
