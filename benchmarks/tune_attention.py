"""Sweep tile sizes, warps and pipeline stages of the FlashAttention kernels on the GPU.

Model-like shape: batch 8, 16 heads, 4096 tokens, causal. For each head dim and dtype it times
the forward kernel and the backward with one kernel's tiles varied at a time (the others at the
GPU's default `attention_config`), printing one JSON line per configuration (median ms and TFLOP/s,
forward FLOPs 2*B*H*N^2*D causal, backward 2.5x), then, on stderr, the best AttentionConfig found
as a Python expression: the entry for the architecture's table in fastlm/ops/flash_attention.py.
Usage: python benchmarks/tune_attention.py [head_dim,...] > tune_attention.jsonl
"""

import dataclasses
import itertools
import json
import sys

import torch
import triton.testing

from fastlm.ops import flash_attention as fa
from fastlm.ops.common import device_arch

BATCH, HEADS, SEQ = 8, 16, 4096
FORWARD = {
    2: list(itertools.product([(64, 64), (128, 32), (128, 64), (128, 128), (64, 128)], [4, 8], [2, 3, 4])),
    4: list(itertools.product([(32, 32), (64, 32), (64, 64), (32, 64)], [4, 8], [1, 2])),
}
BACKWARD = {  # (BLOCK_M queries, BLOCK_N keys)
    2: list(itertools.product([(32, 64), (64, 64), (32, 128), (64, 128), (128, 128), (128, 64)], [4, 8], [2, 3])),
    4: list(itertools.product([(16, 32), (32, 32), (32, 64), (64, 32), (64, 64)], [4, 8], [1, 2])),
}


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as error:  # out of shared memory or registers
        return str(error).splitlines()[0][:160]


def emit(kernel, dim, dtype, tiles: fa.AttentionTiles, ms, flops):
    result = {"ms": ms, "tflops": flops / ms / 1e9} if isinstance(ms, float) else {"error": ms}
    print(json.dumps({"kernel": kernel, "head_dim": dim, "dtype": str(dtype).removeprefix("torch."),
                      "block_m": tiles.block_m, "block_n": tiles.block_n, "warps": tiles.num_warps,
                      "stages": tiles.num_stages, **result}), flush=True)  # fmt: skip


def sweep(kernel, default, candidates, run, dim, dtype, flops) -> fa.AttentionTiles:
    """Time ``run(config)`` with ``kernel``'s tiles set to each candidate; the fastest tiles."""
    best, best_ms = getattr(default, kernel), float("inf")
    for (block_m, block_n), warps, stages in candidates:
        tiles = fa.AttentionTiles(block_m, block_n, warps, stages)
        config = dataclasses.replace(default, **{kernel: tiles})
        ms = bench(lambda config=config: run(config))
        emit(kernel, dim, dtype, tiles, ms, flops)
        if isinstance(ms, float) and ms < best_ms:
            best, best_ms = tiles, ms
    return best


def main():
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
    arch = device_arch(torch.device("cuda"))
    for dtype, dim in itertools.product((torch.bfloat16, torch.float32), dims):
        size = min(dtype.itemsize, 4)
        q, k, v, do = (torch.randn(BATCH, HEADS, SEQ, dim, device="cuda", dtype=dtype) for _ in range(4))
        scale = dim**-0.5
        fwd_flops = 2 * BATCH * HEADS * SEQ * SEQ * dim
        default = fa.attention_config(arch, dtype, dim)
        o, lse = fa._launch_forward(q, k, v, True, scale, default)

        def forward(config):
            return fa._launch_forward(q, k, v, True, scale, config)

        def backward(config):
            return fa._launch_backward(do, q, k, v, o, lse, True, scale, config)

        best = {
            "forward": sweep("forward", default, FORWARD[size], forward, dim, dtype, fwd_flops),
            "dkdv": sweep("dkdv", default, BACKWARD[size], backward, dim, dtype, 2.5 * fwd_flops),
            "dq": sweep("dq", default, BACKWARD[size], backward, dim, dtype, 2.5 * fwd_flops),
        }
        print(f"sm{arch} {str(dtype).removeprefix('torch.')} head dim {dim}: {fa.AttentionConfig(**best)!r}",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
