"""Sweep tile sizes, warps and pipeline stages of the FlashAttention kernels on the GPU.

Model-like shape: batch 8, 16 heads, 4096 tokens, causal. For each head dim and dtype it times
the forward kernel and the backward with one kernel's tiles varied at a time, printing one JSON
line per configuration (median ms and TFLOP/s, forward FLOPs 2*B*H*N^2*D causal, backward 2.5x).
The FORWARD_TILES / DKDV_TILES / DQ_TILES tables in fastlm/ops/flash_attention.py are set from
these runs. Usage: python benchmarks/tune_attention.py [head_dim,...] > tune_attention.jsonl
"""

import itertools
import json
import sys

import torch
import triton.testing

from fastlm.ops import flash_attention as fa

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


def emit(kernel, dim, dtype, tiles, ms, flops):
    result = {"ms": ms, "tflops": flops / ms / 1e9} if isinstance(ms, float) else {"error": ms}
    block_m, block_n = tiles[0]
    print(json.dumps({"kernel": kernel, "head_dim": dim, "dtype": str(dtype).removeprefix("torch."),
                      "block_m": block_m, "block_n": block_n, "warps": tiles[1], "stages": tiles[2], **result}),
          flush=True)  # fmt: skip


def main():
    dims = [int(d) for d in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
    for dtype, dim in itertools.product((torch.bfloat16, torch.float32), dims):
        size = min(torch.tensor([], dtype=dtype).element_size(), 4)
        key = (fa._block_d(dim), size)
        q, k, v, do = (torch.randn(BATCH, HEADS, SEQ, dim, device="cuda", dtype=dtype) for _ in range(4))
        scale = dim**-0.5
        fwd_flops = 2 * BATCH * HEADS * SEQ * SEQ * dim
        default = fa.FORWARD_TILES[key]
        for tiles in FORWARD[size]:
            fa.FORWARD_TILES[key] = (*tiles[0], tiles[1], tiles[2])
            emit("forward", dim, dtype, tiles, bench(lambda: fa._launch_forward(q, k, v, True, scale)), fwd_flops)
        fa.FORWARD_TILES[key] = default
        o, lse = fa._launch_forward(q, k, v, True, scale)
        for table_name in ("DKDV_TILES", "DQ_TILES"):
            table = getattr(fa, table_name)
            default = table[key]
            for tiles in BACKWARD[size]:
                table[key] = (*tiles[0], tiles[1], tiles[2])
                ms = bench(lambda: fa._launch_backward(do, q, k, v, o, lse, True, scale))
                emit(table_name.removesuffix("_TILES").lower(), dim, dtype, tiles, ms, 2.5 * fwd_flops)
            table[key] = default


if __name__ == "__main__":
    main()
