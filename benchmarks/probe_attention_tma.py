"""Probe: does a causal attention forward that loads its tiles through TMA tensor descriptors (Hopper)
beat fastlm's forward, which loads them with pointer arithmetic?

fastlm's forward trails cuDNN by 14-22% at head dim 128 at every length (docs/notes/attention.md
section 8), so the gap is in the kernel, not the grid. This script times, on one GPU, bf16, causal,
(B, H, N, D) contiguous inputs: fastlm's `_launch_forward` with its default tiles, and the same
online-softmax loop with Q, K, V loaded and O stored through `TensorDescriptor`s (host-built, one
2-D (B H N, D) view per tensor), at the same tiles and a few others. It checks the probe's output
against fastlm's first, then prints one JSON line per variant (median ms by do_bench, TFLOP/s by the
causal count 2 B H N^2 D). A probe, not a kernel of the package: dense causal self-attention with
N a multiple of the tiles only.
Usage: python benchmarks/probe_attention_tma.py [--shapes 8,16,4096,128 2,16,16384,128 8,16,4096,64]
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


@triton.jit
def _tma_forward_kernel(
    desc_q, desc_k, desc_v, desc_o,  # descriptors of (B H N, D) views, blocks (BLOCK_M | BLOCK_N, D)
    LSE,  # (B H N,) fp32
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest programs first
    row0 = tl.program_id(1) * N  # this (batch, head)'s first row in the 2-D views
    qk_scale = sm_scale * LOG2E
    q = desc_q.load([row0 + start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -3.0e38, dtype=tl.float32)
    full_end = start_m // BLOCK_N * BLOCK_N  # key tiles every row sees whole
    for start_n in range(0, full_end, BLOCK_N):
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    for start_n in range(full_end, start_m + BLOCK_M, BLOCK_N):  # the diagonal tiles, masked
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
        s = tl.dot(q, tl.trans(k))
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    acc = acc / l_i[:, None]
    desc_o.store([row0 + start_m, 0], acc.to(tl.bfloat16))
    tl.store(LSE + row0 + offs_m, (m_i + tl.math.log2(l_i)) * LN2)


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


TMA_TILES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3)]


def probe(B: int, H: int, N: int, D: int, arch: int) -> None:
    """One JSON line per variant at one shape."""
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    config = fa.attention_config(arch, torch.bfloat16, D, N)
    reference, _ = fa._launch_forward(q, k, v, True, D**-0.5, config)
    variants = {"fastlm": lambda: fa._launch_forward(q, k, v, True, D**-0.5, config)}
    for tiles in TMA_TILES:
        variants[f"tma {tiles}"] = lambda tiles=tiles: tma_forward(q, k, v, *tiles)
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
    args = parser.parse_args()
    arch = device_arch(torch.device("cuda"))
    for shape in args.shapes:
        probe(*(int(x) for x in shape.split(",")), arch)


if __name__ == "__main__":
    main()
