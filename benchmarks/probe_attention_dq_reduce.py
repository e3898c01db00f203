"""Probe: a causal attention backward of 5 matmuls per tile whose dQ is summed by TMA reduce, against
fastlm's deterministic backward (7 matmuls: a dQ kernel, then a dK/dV kernel) and cuDNN's.

Why: at head dim 128 fastlm's backward runs its matmuls about as fast as cuDNN's, but it does 7 per
(query tile, key tile) pair where cuDNN does 5, which caps it near 0.7x of cuDNN's backward
(docs/notes/attention.md, section 12). fastlm's earlier 5-matmul variant added dQ with
`tl.atomic_add` and ran slower than the 7-matmul one (section 8). Here each key-tile program adds
its (BLOCK_M, D) fp32 dQ contributions through a tensor descriptor's `atomic_add`, which Hopper runs
as one bulk reduction per tile (`cp.reduce.async.bulk.tensor`) instead of per-element atomics; dQ is
then cast from its fp32 accumulator (the sums' order varies: not deterministic).

On one GPU, bf16, causal, (B, H, N, D) contiguous, H = Hkv, N a multiple of the tiles: times by
do_bench the backward alone of fastlm (`_launch_backward`), of SDPA's cuDNN backend (autograd.grad
of one forward, graph retained) and of the probe at a few tiles (Dlt = rowsum(dO * O) in PyTorch,
the zeroed fp32 accumulator and the cast of dQ included), checks the probe's gradients against
fastlm's, and appends one record per variant to RESULTS (default
benchmarks/results/attention_dq_reduce.jsonl): ms, TFLOP/s by the conventional count (2.5x the
causal forward's 2 B H N^2 D), max abs difference of dQ, dK, dV against fastlm's.
Usage: python benchmarks/probe_attention_dq_reduce.py [--shapes 8,16,4096,128 ...]
"""

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from fastlm.ops import flash_attention as fa
from fastlm.ops.common import device_arch
from fastlm.ops.constants import LOG2E
from fastlm.utils.records import append_records, with_environment


@triton.jit
def _dq_reduce_backward_kernel(
    Q, K, V, DO,  # (B H N, D) contiguous, bf16
    DQ_ACC,  # (B H N, D) fp32, zeroed: dQ is added here
    DK, DV,  # (B H N, D) bf16, written
    LSE, DELTA,  # (B H N,) fp32: the forward's logsumexp (natural log), rowsum(dO * O)
    N, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program per key tile of one (batch, head): dK and dV over the query tiles that see the
    tile (the diagonal one masked), and each query tile's share of dQ added through TMA reduce."""
    start_n = tl.program_id(0) * BLOCK_N
    row0 = tl.program_id(1) * N
    rows = tl.num_programs(1) * N
    qk_scale = tl.cast(sm_scale, tl.float32) * LOG2E
    # (base, shape, strides, block shape) over all rows: a tile never crosses a head (N % tiles == 0)
    desc_q = tl.make_tensor_descriptor(Q, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_do = tl.make_tensor_descriptor(DO, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(K, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(V, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_dq = tl.make_tensor_descriptor(DQ_ACC, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    desc_dk = tl.make_tensor_descriptor(DK, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    desc_dv = tl.make_tensor_descriptor(DV, [rows, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    k = desc_k.load([row0 + start_n, 0])
    v = desc_v.load([row0 + start_n, 0])
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    full_start = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M  # query tiles from here see the key tile whole
    for start_m in range(start_n // BLOCK_M * BLOCK_M, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = desc_q.load([row0 + start_m, 0])
        do = desc_do.load([row0 + start_m, 0])
        lse = tl.load(LSE + row0 + offs_m)
        delta = tl.load(DELTA + row0 + offs_m)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - (lse * LOG2E)[None, :])  # (BLOCK_N, BLOCK_M)
        if start_m < full_start:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        desc_dq.atomic_add([row0 + start_m, 0], tl.dot(tl.trans(ds_t), k) * sm_scale)  # (BLOCK_M, D) fp32
    desc_dk.store([row0 + start_n, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    desc_dv.store([row0 + start_n, 0], dv.to(DV.dtype.element_ty))


def dq_reduce_backward(q, k, v, o, do, lse, block_m: int, block_n: int, warps: int, stages: int):
    """(dQ, dK, dV) of the probe's backward for (B, H, N, D) contiguous bf16 inputs."""
    B, H, N, D = q.shape
    delta = (o.float() * do.float()).sum(-1)
    dq = torch.zeros(B, H, N, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _dq_reduce_backward_kernel[(N // block_n, B * H)](
        q, k, v, do, dq, dk, dv, lse, delta, N, D**-0.5,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq.to(q.dtype), dk, dv


# (BLOCK_M, BLOCK_N, warps, stages) that fit 227 KB of shared memory at D=128 (compiled for sm90: 209, 176,
# 128, 136 and 169 KB); at D=64 all take half or less
TILES = [(64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 1), (32, 128, 4, 3), (64, 64, 4, 3)]


def probe(B: int, H: int, N: int, D: int, arch: int, results: Path) -> None:
    if N % 128:
        raise SystemExit(f"N must be a multiple of 128, got {N}")
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D**-0.5
    config = fa.attention_config(arch, torch.bfloat16, D, N)
    o, lse = fa._launch_forward(q, k, v, True, scale, config)
    want = fa._launch_backward(do, q, k, v, o, lse, True, scale, config)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        cudnn_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    variants = {
        "fastlm backward": lambda: fa._launch_backward(do, q, k, v, o, lse, True, scale, config),
        "sdpa cudnn backward": lambda: torch.autograd.grad(cudnn_out, leaves, do, retain_graph=True),
    }
    for tiles in TILES:
        variants[f"dq reduce {tiles}"] = lambda tiles=tiles: dq_reduce_backward(q, k, v, o, do, lse, *tiles)
    records = []
    for name, run in variants.items():
        try:
            grads = run()
            error = max((g.float() - w.float()).abs().max().item() for g, w in zip(grads, want, strict=True))
            ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
            result = {"ms": ms, "tflops": 5 * B * H * N * N * D / ms / 1e9, "max_abs_diff_vs_fastlm": error}
        except Exception as failure:  # out of shared memory or registers, or a descriptor the GPU refuses
            result = {"error": f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"}
        record = {"variant": name, "batch": B, "heads": H, "seq": N, "head_dim": D, "causal": True, **result}
        print(json.dumps(record), flush=True)
        records.append(with_environment({"op": "attention_dq_reduce_probe", "dtype": "bfloat16", **record}))
    append_records(results, records)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8,16,4096,128", "2,16,16384,128", "8,16,4096,64"])
    args = parser.parse_args()
    arch = device_arch(torch.device("cuda"))
    # descriptors made in a kernel live in global scratch memory, which eager launches take from here
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    results = Path(os.environ.get("RESULTS", "benchmarks/results/attention_dq_reduce.jsonl"))
    for shape in args.shapes:
        probe(*(int(x) for x in shape.split(",")), arch, results)


if __name__ == "__main__":
    main()
