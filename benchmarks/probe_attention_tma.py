"""Probe: does a causal attention forward that loads its tiles through TMA tensor descriptors (Hopper)
beat fastlm's forward, which loads them with pointer arithmetic?

fastlm's forward trails cuDNN by 14-22% at head dim 128 at every length (docs/notes/attention.md
section 8), so the gap is in the kernel, not the grid. This script times, on one GPU, bf16, causal,
(B, H, N, D) contiguous inputs: fastlm's `_launch_forward` with its default tiles, and the same
online-softmax loop with Q, K, V loaded and O stored through `TensorDescriptor`s (host-built, one
2-D (B H N, D) view per tensor), at the same tiles and a few others. It checks the probe's output
against fastlm's first, then prints one JSON line per variant (median ms by do_bench, TFLOP/s by the
causal count 2 B H N^2 D). The same for the backward's dK/dV kernel (`--backward`): fastlm's
`_flash_backward_dkdv_kernel` launched alone against a TMA twin with host descriptors and one with
descriptors made in the kernel over token-major views (TFLOP/s by 4 of the backward's matmuls,
4 B H N^2 D causal), and (`--inductor`) whether torch.compile takes a `triton_op` whose
kernel gets TensorDescriptor arguments. The "device tma" variants build their descriptors inside
the kernel (`tl.make_tensor_descriptor`, one per (batch, head) over its (N, D) rows at the input's
strides: the model's token-major views, and N that is no multiple of the tiles, whose rows past N
TMA zero-fills and clips), which needs Triton's scratch allocator in eager mode and Inductor's
support for a user kernel's global scratch under torch.compile (`--inductor` checks both kinds). A
probe, not a kernel of the package: dense causal self-attention, H = Hkv; the host-descriptor
variants need N a multiple of the tiles.
Usage: python benchmarks/probe_attention_tma.py [--shapes 8,16,4096,128 ...] [--backward] [--inductor]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastlm.ops import flash_attention as fa
from fastlm.ops.common import device_arch
from fastlm.ops.constants import LN2, LOG2E
from fastlm.ops.flash_attention.kernels import _flash_backward_dkdv_kernel


@triton.jit
def _causal_rows(
    q, desc_k, desc_v,  # q: the query tile (BLOCK_M, D); K, V descriptors of blocks (BLOCK_N, D)
    row0, start_m, sm_scale,  # the head's first row in the descriptors' rows; the tile's first query
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The online-softmax loop of both probe forwards: (O of the tile, L of its rows)."""
    qk_scale = tl.cast(sm_scale, tl.float32) * LOG2E  # fp64 under torch.compile
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -3.0e38, dtype=tl.float32)
    full_end = start_m // BLOCK_N * BLOCK_N  # key tiles every row sees whole; then the diagonal, masked
    for start_n in range(0, start_m + BLOCK_M, BLOCK_N):
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
        s = tl.dot(q, tl.trans(k))
        if start_n >= full_end:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc / l_i[:, None], (m_i + tl.math.log2(l_i)) * LN2


@triton.jit
def _tma_forward_kernel(
    desc_q, desc_k, desc_v, desc_o,  # descriptors of (B H N, D) views, blocks (BLOCK_M | BLOCK_N, D)
    LSE,  # (B H N,) fp32
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest programs first
    row0 = tl.program_id(1) * N  # this (batch, head)'s first row in the 2-D views
    q = desc_q.load([row0 + start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc, lse = _causal_rows(q, desc_k, desc_v, row0, start_m, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N)
    desc_o.store([row0 + start_m, 0], acc.to(tl.bfloat16))
    tl.store(LSE + row0 + offs_m, lse)


def tma_forward(q, k, v, block_m: int, block_n: int, warps: int, stages: int):
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    rows = lambda t, block: TensorDescriptor.from_tensor(t.view(B * H * N, D), [block, D])  # noqa: E731
    _tma_forward_kernel[(N // block_m, B * H)](
        rows(q, block_m), rows(k, block_n), rows(v, block_n), rows(o, block_m), lse, N, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o, lse


@triton.jit
def _device_tma_forward_kernel(
    Q, K, V, Out,  # (B, H, N, D), any strides with D's 1 and the others 16-byte multiples
    LSE,  # (B, H, N) fp32 contiguous
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
    H, N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`_tma_forward_kernel`'s loop with descriptors made here, one per tensor over this (batch,
    head)'s (N, D) rows: keys past N come back as zeros, which the causal mask hides from every row
    below N; O's rows past N are clipped by the store."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest programs first
    z, h = tl.program_id(2), tl.program_id(1)
    q_rows, o_rows = Q + z * stride_qz + h * stride_qh, Out + z * stride_oz + h * stride_oh
    k_rows, v_rows = K + z * stride_kz + h * stride_kh, V + z * stride_vz + h * stride_vh
    # (base, shape, strides, block shape)
    desc_q = tl.make_tensor_descriptor(q_rows, [N, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(k_rows, [N, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(v_rows, [N, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM])
    desc_o = tl.make_tensor_descriptor(o_rows, [N, HEAD_DIM], [stride_om, 1], [BLOCK_M, HEAD_DIM])
    q = desc_q.load([start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc, lse = _causal_rows(q, desc_k, desc_v, 0, start_m, sm_scale, HEAD_DIM, BLOCK_M, BLOCK_N)
    desc_o.store([start_m, 0], acc.to(Out.dtype.element_ty))
    tl.store(LSE + (z * H + h) * N + offs_m, lse, mask=offs_m < N)


def device_tma_forward(q, k, v, block_m: int, block_n: int, warps: int, stages: int, launch=None):
    """O (q's strides) and L of `_device_tma_forward_kernel`; ``launch`` wraps the kernel (e.g.
    ``wrap_triton`` inside a triton_op)."""
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    kernel = (launch or (lambda fn: fn))(_device_tma_forward_kernel)
    kernel[(triton.cdiv(N, block_m), H, B)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, N, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return o, lse


@triton.jit
def _dkdv_rows(
    desc_q, desc_k, desc_v, desc_do,  # blocks of BLOCK_M rows (q, do) and BLOCK_N rows (k, v)
    lse_rows, delta_rows,  # this head's (N,) fp32 logsumexp and rowsum(dO * O)
    row0, start_n, N, qk_scale,  # the head's first row in the descriptors' rows; the key tile's first key
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The dK (unscaled) and dV, fp32, of one key tile over the query tiles that see it: the diagonal
    one (masked), then those that see it whole. The loop of both probe dK/dV kernels."""
    k = desc_k.load([row0 + start_n, 0])
    v = desc_v.load([row0 + start_n, 0])
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    full_start = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M  # query tiles past it see the key tile whole
    for start_m in range(start_n // BLOCK_M * BLOCK_M, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = desc_q.load([row0 + start_m, 0])
        do = desc_do.load([row0 + start_m, 0])
        lse = tl.load(lse_rows + offs_m)
        delta = tl.load(delta_rows + offs_m)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - (lse * LOG2E)[None, :])
        if start_m < full_start:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _head_rows(base, stride_z, stride_h, stride_row, z, h, N, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A descriptor over the (N, D) rows of head h of batch entry z of a (B, H, N, D) tensor, loading
    and storing blocks of BLOCK rows."""
    return tl.make_tensor_descriptor(
        base + z * stride_z + h * stride_h, [N, HEAD_DIM], [stride_row, 1], [BLOCK, HEAD_DIM]
    )


@triton.jit
def _tma_dkdv_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv,  # (B H N, D) views; blocks BLOCK_M (q, do), BLOCK_N
    LSE, DELTA,  # (B H N,) fp32
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per key tile of one (batch, head): dK and dV over the query tiles that see it."""
    start_n = tl.program_id(0) * BLOCK_N
    row0 = tl.program_id(1) * N
    qk_scale = tl.cast(sm_scale, tl.float32) * LOG2E  # fp64 under torch.compile
    dk, dv = _dkdv_rows(
        desc_q,
        desc_k,
        desc_v,
        desc_do,
        LSE + row0,
        DELTA + row0,
        row0,
        start_n,
        N,
        qk_scale,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
    )
    desc_dk.store([row0 + start_n, 0], (dk * sm_scale).to(tl.bfloat16))
    desc_dv.store([row0 + start_n, 0], dv.to(tl.bfloat16))


def tma_dkdv(q, k, v, do, lse, delta, block_m: int, block_n: int, warps: int, stages: int):
    B, H, N, D = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    rows = lambda t, block: TensorDescriptor.from_tensor(t.view(B * H * N, D), [block, D])  # noqa: E731
    _tma_dkdv_kernel[(N // block_n, B * H)](
        rows(q, block_m), rows(k, block_n), rows(v, block_n), rows(do, block_m), rows(dk, block_n),
        rows(dv, block_n), lse, delta, N, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dk, dv


@triton.jit
def _device_tma_dkdv_kernel(
    Q, K, V, DO, DK, DV,  # (B, H, N, D), any strides with D's 1 and the others 16-byte multiples
    LSE, DELTA,  # (B, H, N) fp32 contiguous
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
    stride_doz, stride_doh, stride_dom, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    H, N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`_tma_dkdv_kernel`'s loop with descriptors made here, one per tensor over this (batch, head)'s
    (N, D) rows, so that it reads the model's token-major views (N a multiple of the tiles)."""
    start_n = tl.program_id(0) * BLOCK_N
    z, h = tl.program_id(2), tl.program_id(1)
    qk_scale = tl.cast(sm_scale, tl.float32) * LOG2E
    desc_q = _head_rows(Q, stride_qz, stride_qh, stride_qm, z, h, N, HEAD_DIM, BLOCK_M)
    desc_do = _head_rows(DO, stride_doz, stride_doh, stride_dom, z, h, N, HEAD_DIM, BLOCK_M)
    desc_k = _head_rows(K, stride_kz, stride_kh, stride_kn, z, h, N, HEAD_DIM, BLOCK_N)
    desc_v = _head_rows(V, stride_vz, stride_vh, stride_vn, z, h, N, HEAD_DIM, BLOCK_N)
    desc_dk = _head_rows(DK, stride_dkz, stride_dkh, stride_dkn, z, h, N, HEAD_DIM, BLOCK_N)
    desc_dv = _head_rows(DV, stride_dvz, stride_dvh, stride_dvn, z, h, N, HEAD_DIM, BLOCK_N)
    row0 = (z * H + h) * N  # this head's first row of LSE and DELTA
    dk, dv = _dkdv_rows(
        desc_q, desc_k, desc_v, desc_do, LSE + row0, DELTA + row0, 0, start_n, N, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N
    )
    desc_dk.store([start_n, 0], (dk * sm_scale).to(tl.bfloat16))
    desc_dv.store([start_n, 0], dv.to(tl.bfloat16))


def device_tma_dkdv(q, k, v, do, lse, delta, block_m: int, block_n: int, warps: int, stages: int):
    """dK and dV (k's and v's strides) of `_device_tma_dkdv_kernel`."""
    B, H, N, D = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _device_tma_dkdv_kernel[(N // block_n, H, B)](
        q, k, v, do, dk, dv, lse, delta, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3], H, N, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dk, dv


def fastlm_dkdv(q, k, v, do, lse, delta, tiles: fa.AttentionTiles):
    """fastlm's dK/dV kernel alone, with the arguments `_launch_backward` gives it (dense, causal)."""
    B, H, N, D = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _flash_backward_dkdv_kernel[(N // tiles.block_n, H, B)](
        q, k, v, do, lse, delta, dk, dv, None, None, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *dk.stride()[:3], H * N, N, H, 1, N, N, 0, D**-0.5, 0, 0,
        BOUNDED_LEFT=False, BOUNDED_RIGHT=True, VARLEN=False, HEAD_DIM=D, BLOCK_D=D, PRECISION="ieee",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return dk, dv


def probe_backward(B: int, H: int, N: int, D: int, arch: int) -> None:
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    config = fa.attention_config(arch, torch.bfloat16, D, N)
    o, lse = fa._launch_forward(q, k, v, True, D**-0.5, config)
    delta = (o.float() * do.float()).sum(-1)
    _, want_dk, want_dv = fa._launch_backward(do, q, k, v, o, lse, True, D**-0.5, config)
    # the model's layout: (B, H, N, D) views of (B, N, H, D) projections
    tq, tk, tv, tdo = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    variants = {
        "fastlm dkdv": lambda: fastlm_dkdv(q, k, v, do, lse, delta, config.dkdv),
        "fastlm dkdv token-major": lambda: fastlm_dkdv(tq, tk, tv, tdo, lse, delta, config.dkdv),
    }
    tiles_list = [(64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)]
    for tiles in tiles_list:
        variants[f"tma dkdv {tiles}"] = lambda tiles=tiles: tma_dkdv(q, k, v, do, lse, delta, *tiles)
    for tiles in tiles_list:
        variants[f"device tma dkdv token-major {tiles}"] = lambda tiles=tiles: device_tma_dkdv(
            tq, tk, tv, tdo, lse, delta, *tiles
        )
    for name, run in variants.items():
        try:
            dk, dv = run()
            error = max(
                (dk.float() - want_dk.float()).abs().max().item(), (dv.float() - want_dv.float()).abs().max().item()
            )
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            result = {"ms": ms, "tflops": 4 * B * H * N * N * D / ms / 1e9, "max_abs_diff_vs_fastlm": error}
        except Exception as failure:  # out of shared memory or registers
            result = {"error": str(failure).splitlines()[0][:160]}
        print(json.dumps({"variant": name, "batch": B, "heads": H, "seq": N, "head_dim": D, **result}), flush=True)


def probe_inductor() -> None:
    """A triton_op that builds TensorDescriptors and launches the TMA forward through wrap_triton,
    called under torch.compile: does Inductor take descriptor arguments?"""
    from torch.library import triton_op, wrap_triton

    @triton_op("probe::tma_forward", mutates_args=())
    def tma_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, N, D = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
        rows = lambda t: TensorDescriptor.from_tensor(t.view(B * H * N, D), [128, D])  # noqa: E731
        wrap_triton(_tma_forward_kernel)[(N // 128, B * H)](
            rows(q), rows(k), rows(v), rows(o), lse, N, D**-0.5, HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, num_warps=8,
            num_stages=3,
        )  # fmt: skip
        return o

    @triton_op("probe::device_tma_forward", mutates_args=())
    def device_tma_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return device_tma_forward(q, k, v, 128, 128, 8, 3, launch=wrap_triton)[0]

    q, k, v = (torch.randn(2, 4, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, op in (
        ("inductor triton_op with TensorDescriptor arguments", tma_op),
        ("inductor triton_op with descriptors made in the kernel", device_tma_op),
    ):
        try:
            eager = op(q, k, v)
            torch._dynamo.reset()
            compiled = torch.compile(lambda q, k, v, op=op: op(q * 1, k, v), fullgraph=True)(q, k, v)
            result = {"equal": bool(torch.equal(eager, compiled))}
        except Exception as failure:
            result = {"error": f"{type(failure).__name__}: {str(failure).splitlines()[0][:300]}"}
        print(json.dumps({"variant": name, **result}), flush=True)


TMA_TILES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3)]


def probe(B: int, H: int, N: int, D: int, arch: int) -> None:
    """One JSON line per variant at one shape."""
    if N % 128:  # a tile past a head's end would read the next head's rows through the 2-D views
        raise SystemExit(f"N must be a multiple of 128, got {N}")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # the model's layout: (B, H, N, D) views of (B, N, H, D) projections
    tq, tk, tv = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    config = fa.attention_config(arch, torch.bfloat16, D, N)
    reference, _ = fa._launch_forward(q, k, v, True, D**-0.5, config)
    variants = {
        "fastlm": lambda: fa._launch_forward(q, k, v, True, D**-0.5, config),
        "fastlm token-major": lambda: fa._launch_forward(tq, tk, tv, True, D**-0.5, config),
    }
    for tiles in TMA_TILES:
        variants[f"tma {tiles}"] = lambda tiles=tiles: tma_forward(q, k, v, *tiles)
    for tiles in TMA_TILES:
        variants[f"device tma token-major {tiles}"] = lambda tiles=tiles: device_tma_forward(tq, tk, tv, *tiles)
    for name, run in variants.items():
        try:
            out, _ = run()
            error = (out.float() - reference.float()).abs().max().item()
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            result = {"ms": ms, "tflops": 2 * B * H * N * N * D / ms / 1e9, "max_abs_diff_vs_fastlm": error}
        except Exception as failure:  # out of shared memory or registers
            result = {"error": str(failure).splitlines()[0][:160]}
        print(json.dumps({"variant": name, "batch": B, "heads": H, "seq": N, "head_dim": D, **result}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8,16,4096,128", "2,16,16384,128", "8,16,4096,64"])
    parser.add_argument("--backward", action="store_true", help="also the dK/dV kernel")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile of a triton_op with descriptors")
    args = parser.parse_args()
    arch = device_arch(torch.device("cuda"))
    # descriptors made in a kernel live in global scratch memory, which eager launches take from here
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    if args.inductor:
        probe_inductor()
    for shape in args.shapes:
        probe(*(int(x) for x in shape.split(",")), arch)
        if args.backward:
            probe_backward(*(int(x) for x in shape.split(",")), arch)


if __name__ == "__main__":
    main()
