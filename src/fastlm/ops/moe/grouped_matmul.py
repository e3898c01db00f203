"""Matrix products over the experts' variable-size groups of rows, without a host sync.

The rows of a mixture of experts' computation are the (token, expert) pairs, sorted by expert
(`permute.expert_order`): expert e owns sorted rows [offsets[e], offsets[e + 1]). Two products:

    grouped_matmul       C[s, :] = scale[s] * A[rows[s], :] @ B[e(s)]^T          (S, N)
                         A (R, K) (rows[s] gathers it: token order read in expert order, no copy),
                         B (E, N, K) by strides (a transposed weight costs nothing)
    grouped_weight_grad  dB[e] = sum over s in e of (scale[s] G[g_rows[s], :])^T X[x_rows[s], :]
                         (E, N, K): each expert's rows summed in order by one program per tile, so
                         the result is deterministic (no atomics)

grouped_matmul's epilogue fuses the experts' gating (the activations of `fastlm.swiglu` and
`fastlm.geglu`): "glu" takes B with 2N rows, gate rows [0, N) and up rows [N, 2N) (transformers'
gate_up_proj), writes both projections to GU (S, 2N) for the backward and act(g) * u to C (S, N);
"glu_backward" multiplies C's product dh by the gating's derivative, read from the saved GU, and
writes (dg, du) as C (S, 2N). g, u and dh are rounded to the output dtype before the gating uses
them, as the unfused computation rounds them, so the fusion changes no value.

Scheduling: a grouped_matmul program owns a (BLOCK_M, BLOCK_N) tile of one expert's rows. The
number of row tiles, sum_e ceil(count_e / BLOCK_M), is known only on the device, so the grid has its
upper bound, ceil(S / BLOCK_M) + E row tiles, and each program finds its expert by counting the
experts whose cumulative tile count (TILE_ENDS) it has passed; the programs past the last tile
return at once. Both grids are one-dimensional and walk their tiles in groups (`_swizzle`) so that
the rows and weights a program reads are still in L2 from its neighbours; grouped_weight_grad's
runs expert by expert. Cost: 2 S N K FLOPs (GLU: 4 S N K), and for bytes S K + E N K read (the gather
reads each token's row once per expert it goes to) and S N written (GLU: 3 S N).

Where the kernels do not run (CPU tensors without the interpreter, fake tensors while torch.compile
traces on a CPU) both products are PyTorch ops in a loop over the experts, each masked to its rows:
E times the FLOPs, but no shape depends on the data, so the loop traces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastlm.ops.common import cdiv, device_arch, dot_precision, next_power_of_2, runs_triton
from fastlm.ops.launch import launcher
from fastlm.ops.swiglu import _activation, _activation_and_slope, _activation_and_slope_torch, _activation_torch

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _expert_tile(pid_m, TILE_ENDS, OFFSETS, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid_m``; expert E for a tile past the last one."""
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(TILE_ENDS + experts, mask=experts < E, other=2**30)  # (BLOCK_E,) cumulative tiles
    expert = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    first_tile = tl.load(TILE_ENDS + expert - 1, mask=(expert > 0) & (expert <= E), other=0)
    start = tl.load(OFFSETS + expert, mask=expert < E, other=0) + (pid_m - first_tile) * BLOCK_M
    end = tl.load(OFFSETS + expert + 1, mask=expert < E, other=0)
    return expert, start, end


@triton.jit
def _swizzle(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in a (tiles_m, tiles_n) grid walked GROUP_M rows of tiles at
    a time, column by column: consecutive programs share their column's B tile and the group's
    GROUP_M A tiles, which stay in L2 while the group sweeps the columns."""
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % group) % rows, (pid % group) // rows


@triton.jit
def _grouped_matmul_kernel(
    A,  # (R, K) rows, strides (stride_am, stride_ak)
    B,  # (E, N or 2N, K): B[e, n, k] at e * stride_be + n * stride_bn + k * stride_bk
    C,  # (S, N) output, contiguous; (S, 2N) for GLU_BACKWARD (dg | du)
    GU,  # (S, 2N) contiguous: written by EPILOGUE "glu" (g | u), read by "glu_backward"; else unused
    A_ROWS,  # (S,) int32: the row of A of sorted row s; unread without GATHER
    ROW_SCALE,  # (S,) fp32: the factor of sorted row s; unread without SCALE
    OFFSETS,  # (E + 1,) int32: expert e's sorted rows are [OFFSETS[e], OFFSETS[e + 1])
    TILE_ENDS,  # (E,) int32: tiles of BLOCK_M rows of experts 0..e
    M_TILES, N, K, E, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
    EPILOGUE: tl.constexpr,  # "none", "glu" or "glu_backward" (module docstring)
    ACTIVATION: tl.constexpr,  # the gating's activation: "silu", "gelu_tanh" or "gelu"
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """Grid (M_TILES * ceil(N / BLOCK_N),), M_TILES = ceil(S / BLOCK_M) + E row tiles at most."""
    pid_m, pid_n = _swizzle(tl.program_id(0), M_TILES, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, start, end = _expert_tile(pid_m, TILE_ENDS, OFFSETS, E, BLOCK_M, BLOCK_E)
    if expert >= E:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    a_rows = tl.load(A_ROWS + rows, mask=row_mask, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b = B + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the up projection ("glu" only)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b_mask = k_mask[:, None] & col_mask[None, :]
        b_tile = tl.load(
            b + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask, other=0.0
        )  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b_tile.to(a.dtype), acc, input_precision=PRECISION)
        if EPILOGUE == "glu":
            b_up = tl.load(b + ks[:, None] * stride_bk + (cols + N)[None, :] * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up.to(a.dtype), acc_up, input_precision=PRECISION)
    if SCALE:
        acc *= tl.load(ROW_SCALE + rows, mask=row_mask, other=0.0)[:, None]
    out_mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    out_dtype = C.dtype.element_ty
    if EPILOGUE == "none":
        tl.store(C + rows64[:, None] * N + cols[None, :], acc.to(out_dtype), mask=out_mask)
    elif EPILOGUE == "glu":
        g = acc.to(out_dtype)
        u = acc_up.to(out_dtype)
        tl.store(GU + rows64[:, None] * (2 * N) + cols[None, :], g, mask=out_mask)
        tl.store(GU + rows64[:, None] * (2 * N) + (cols + N)[None, :], u, mask=out_mask)
        h = _activation(g.to(tl.float32), ACTIVATION) * u.to(tl.float32)
        tl.store(C + rows64[:, None] * N + cols[None, :], h.to(out_dtype), mask=out_mask)
    else:  # "glu_backward": acc is dh
        dh = acc.to(out_dtype).to(tl.float32)
        g = tl.load(GU + rows64[:, None] * (2 * N) + cols[None, :], mask=out_mask, other=0.0).to(tl.float32)
        u = tl.load(GU + rows64[:, None] * (2 * N) + (cols + N)[None, :], mask=out_mask, other=0.0).to(tl.float32)
        act, slope = _activation_and_slope(g, ACTIVATION)
        tl.store(C + rows64[:, None] * (2 * N) + cols[None, :], (dh * u * slope).to(out_dtype), mask=out_mask)
        tl.store(C + rows64[:, None] * (2 * N) + (cols + N)[None, :], (dh * act).to(out_dtype), mask=out_mask)


@triton.jit
def _grouped_weight_grad_kernel(
    G,  # (R_g, N) upstream rows, strides (stride_gm, stride_gn)
    X,  # (R_x, K) input rows, strides (stride_xm, stride_xk)
    DB,  # (E, N, K) output, contiguous
    G_ROWS,  # (S,) int32: G's row of sorted row s; unread without GATHER_G
    X_ROWS,  # (S,) int32: X's row of sorted row s; unread without GATHER_X
    ROW_SCALE,  # (S,) fp32: the factor of G's sorted row s; unread without SCALE
    OFFSETS,  # (E + 1,) int32
    N, K, stride_gm, stride_gn, stride_xm, stride_xk,
    GATHER_G: tl.constexpr,
    GATHER_X: tl.constexpr,
    SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # sorted rows per step of the reduction
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
):  # fmt: skip
    """Grid (E * ceil(N / BLOCK_N) * ceil(K / BLOCK_K),), expert by expert (their rows stay in L2
    while its tiles run); an expert without rows writes zeros."""
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    expert = tl.program_id(0) // (tiles_n * tiles_k)
    pid_n, pid_k = _swizzle(tl.program_id(0) % (tiles_n * tiles_k), tiles_n, tiles_k, GROUP_N)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = ns < N
    k_mask = ks < K
    start = tl.load(OFFSETS + expert)
    end = tl.load(OFFSETS + expert + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        g_rows = tl.load(G_ROWS + rows, mask=row_mask, other=0).to(tl.int64) if GATHER_G else rows.to(tl.int64)
        x_rows = tl.load(X_ROWS + rows, mask=row_mask, other=0).to(tl.int64) if GATHER_X else rows.to(tl.int64)
        g = tl.load(
            G + g_rows[:, None] * stride_gm + ns[None, :] * stride_gn,
            mask=row_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        x = tl.load(
            X + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if SCALE:
            scale = tl.load(ROW_SCALE + rows, mask=row_mask, other=0.0)
            g = (g.to(tl.float32) * scale[:, None]).to(x.dtype)
        acc = tl.dot(tl.trans(g.to(x.dtype)), x, acc, input_precision=PRECISION)  # (BLOCK_N, BLOCK_K)
    out = DB + expert.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, acc.to(DB.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tiles and warps of both kernels. block_m is also the tile of an expert's rows that
    `expert_order`'s TILE_ENDS count in."""

    block_m: int  # sorted rows per tile (grouped_matmul), per reduction step (grouped_weight_grad)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group: int = 8  # row tiles (grouped_matmul) or column tiles (grouped_weight_grad) walked together


# By device_arch, then by kernel ("matmul"; "glu": two accumulators; "glu_backward": the gating's
# derivative read and two outputs written; "weight_grad"). H100 / H200 (90): from
# benchmarks/tune_moe.py on an H200 at the Qwen3-30B-A3B and Mixtral-8x7B layers, 16384 tokens; the
# interpreter (0) gets the smallest tiles tl.dot takes.
_CONFIGS = {
    90: {
        "matmul": GroupedMatmulConfig(128, 256, 64, num_warps=8, num_stages=3),
        "glu": GroupedMatmulConfig(128, 128, 64, num_warps=8, num_stages=4),
        "glu_backward": GroupedMatmulConfig(128, 128, 64, num_warps=8, num_stages=3),
        "weight_grad": GroupedMatmulConfig(64, 128, 128, num_warps=8, num_stages=3),
    },
    0: dict.fromkeys(
        ("matmul", "glu", "glu_backward", "weight_grad"), GroupedMatmulConfig(16, 16, 16, num_warps=4, num_stages=1)
    ),
}
# fp32 inputs on H100 / H200: the 16-bit tiles' pipelines need twice the shared memory, past the
# 227 KiB an SM has; these keep 3 stages within it (192 KiB)
_FP32_CONFIGS_90 = {
    "matmul": GroupedMatmulConfig(128, 128, 64, num_warps=8, num_stages=3),
    "glu": GroupedMatmulConfig(128, 64, 64, num_warps=8, num_stages=3),
    "glu_backward": GroupedMatmulConfig(128, 128, 64, num_warps=8, num_stages=3),
    "weight_grad": GroupedMatmulConfig(64, 128, 128, num_warps=8, num_stages=3),
}


def _matmul_kind(epilogue: str) -> str:
    """The configuration table's kernel of a grouped_matmul epilogue."""
    return "matmul" if epilogue == "none" else epilogue


@functools.cache
def grouped_matmul_config(arch: int, kernel: str, element_size: int = 2) -> GroupedMatmulConfig:
    """The configuration of ``kernel`` ("matmul", "glu", "glu_backward", "weight_grad") on GPU
    architecture ``arch`` (`device_arch`) for inputs of ``element_size`` bytes; GPUs nobody
    measured take the H100 / H200 one."""
    if arch != 0 and element_size == 4:
        return _FP32_CONFIGS_90[kernel]
    return _CONFIGS.get(arch, _CONFIGS[90])[kernel]


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_launch_grouped_matmul = launcher(_grouped_matmul_kernel)
_launch_grouped_weight_grad = launcher(_grouped_weight_grad_kernel)


def tile_ends(offsets: torch.Tensor, block_m: int) -> torch.Tensor:
    """(E,) int32: how many tiles of ``block_m`` rows experts 0..e take, from their (E + 1,) offsets."""
    counts = offsets[1:] - offsets[:-1]
    return torch.cumsum(torch.div(counts + (block_m - 1), block_m, rounding_mode="floor"), 0, dtype=torch.int32)


def grouped_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    epilogue: str = "none",
    gu: torch.Tensor | None = None,
    activation: str = "silu",
    traced: bool = False,
    config: GroupedMatmulConfig | None = None,
):
    """C (S, N) for sorted rows S = ``rows``' length (or a's rows): a (R, K), b (E, N, K) or for
    "glu" (E, 2N, K), any strides; ``offsets`` (E + 1,) int32. "glu" returns (C, GU); "glu_backward"
    reads ``gu`` (S, 2N) and returns C (S, 2N). Rows past offsets[E] are left unwritten. ``config``:
    the table's (`grouped_matmul_config`) unless given (the tuning sweeps)."""
    s = a.shape[0] if rows is None else rows.shape[0]
    e, n_b, k = b.shape
    n = n_b // 2 if epilogue == "glu" else n_b
    config = config or grouped_matmul_config(device_arch(a.device), _matmul_kind(epilogue), a.element_size())
    if not runs_triton(a):
        return _grouped_matmul_torch(a, b, offsets, rows, scale, epilogue, gu, activation)
    c = torch.empty((s, 2 * n if epilogue == "glu_backward" else n), dtype=a.dtype, device=a.device)
    if epilogue == "glu":
        gu = torch.empty((s, 2 * n), dtype=a.dtype, device=a.device)
    if s and n:
        m_tiles = cdiv(s, config.block_m) + e
        _launch_grouped_matmul(traced)[(m_tiles * cdiv(n, config.block_n),)](
            a, b, c, c if gu is None else gu, c if rows is None else rows, c if scale is None else scale,
            offsets, tile_ends(offsets, config.block_m),
            m_tiles, n, k, e, *a.stride(), *b.stride(),
            EPILOGUE=epilogue, ACTIVATION=activation, GATHER=rows is not None, SCALE=scale is not None,
            PRECISION=dot_precision(a.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, BLOCK_E=max(2, next_power_of_2(e)), GROUP_M=config.group,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
    return (c, gu) if epilogue == "glu" else c


def grouped_weight_grad(
    g: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    experts: int,
    g_rows: torch.Tensor | None = None,
    x_rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    traced: bool = False,
    config: GroupedMatmulConfig | None = None,
) -> torch.Tensor:
    """dB (E, N, K) in ``dtype`` (x's by default): g (R_g, N), x (R_x, K), any strides. ``config``:
    the table's unless given."""
    n, k = g.shape[1], x.shape[1]
    if not runs_triton(x):
        return _grouped_weight_grad_torch(g, x, offsets, experts, g_rows, x_rows, scale, dtype or x.dtype)
    config = config or grouped_matmul_config(device_arch(x.device), "weight_grad", x.element_size())
    db = torch.empty((experts, n, k), dtype=dtype or x.dtype, device=x.device)
    if n and k:
        grid = (experts * cdiv(n, config.block_n) * cdiv(k, config.block_k),)
        _launch_grouped_weight_grad(traced)[grid](
            g, x, db, db if g_rows is None else g_rows, db if x_rows is None else x_rows,
            db if scale is None else scale, offsets,
            n, k, *g.stride(), *x.stride(),
            GATHER_G=g_rows is not None, GATHER_X=x_rows is not None, SCALE=scale is not None,
            PRECISION=dot_precision(x.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_N=config.group, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )  # fmt: skip
    return db


# ----------------------------------------------------------------------------------------------
# PyTorch paths (module docstring)
# ----------------------------------------------------------------------------------------------


def _expert_masks(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """(E, rows) bool: sorted row s belongs to expert e."""
    s = torch.arange(rows, device=offsets.device)
    return (s >= offsets[:-1, None]) & (s < offsets[1:, None])


def _grouped_matmul_torch(a, b, offsets, rows, scale, epilogue, gu, activation):
    """`grouped_matmul` in PyTorch, rounding where the kernel rounds; rows of no expert are 0."""
    compute = torch.promote_types(a.dtype, torch.float32)
    a_rows = (a if rows is None else a[rows.long()]).to(compute)
    masks = _expert_masks(offsets, a_rows.shape[0])
    acc = a_rows.new_zeros((a_rows.shape[0], b.shape[1]))
    for expert in range(b.shape[0]):
        acc = acc + torch.where(masks[expert, :, None], a_rows @ b[expert].to(compute).T, 0.0)
    if scale is not None:
        acc = acc * scale[:, None]
    if epilogue == "none":
        return acc.to(a.dtype)
    if epilogue == "glu":
        gu = acc.to(a.dtype)
        g, u = gu.to(compute).chunk(2, dim=-1)
        return (_activation_torch(g, activation) * u).to(a.dtype), gu
    dh = acc.to(a.dtype).to(compute)  # "glu_backward"
    g, u = gu.to(compute).chunk(2, dim=-1)
    act, slope = _activation_and_slope_torch(g, activation)
    return torch.cat([dh * u * slope, dh * act], dim=-1).to(a.dtype)


def _grouped_weight_grad_torch(g, x, offsets, experts, g_rows, x_rows, scale, dtype):
    """`grouped_weight_grad` in PyTorch: each expert's rows masked, the others' products 0."""
    compute = torch.promote_types(x.dtype, torch.float32)
    g = (g if g_rows is None else g[g_rows.long()]).to(compute)
    if scale is not None:  # rounded to x's dtype, as the kernel feeds tl.dot
        g = (g * scale[:, None]).to(x.dtype).to(compute)
    x = (x if x_rows is None else x[x_rows.long()]).to(compute)
    masks = _expert_masks(offsets, g.shape[0])
    return torch.stack([(g * masks[expert, :, None]).T @ x for expert in range(experts)]).to(dtype)
