"""Sweep the chunk width and warps of the looped (long-row) masked-softmax kernels.

Rows wider than BLOCK_MAX take two passes over chunks; the chunk width sets the registers per
program, so how many programs share an SM, so how many rows are read at once and whether a row's
second pass still finds it in L2. The long-row shapes of `fastlm bench softmax`, bf16 and fp32; one
JSON line per configuration with the median ms and the GB/s of the minimum-bytes model.
Usage: python benchmarks/tune_softmax.py > tune_softmax.jsonl
"""

import functools
import itertools
import json

import torch
import triton.testing

from fastlm.bench.softmax import GPU_SHAPES, softmax_bytes
from fastlm.ops import masked_softmax as softmax_module
from fastlm.ops.common import RowTiles


def _looped(block, warps, sk):
    return RowTiles(1, block, False, warps)


def main():
    default = softmax_module.tiles
    long_rows = [shape for shape in GPU_SHAPES if shape[-1] > softmax_module.BLOCK_MAX]
    for shape, dtype in itertools.product(long_rows, (torch.bfloat16, torch.float32)):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for block, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
            softmax_module.tiles = functools.partial(_looped, block, warps)
            y = softmax_module._forward(x, None, 1.0, False)
            stages = {
                "fwd": functools.partial(softmax_module._forward, x, None, 1.0, False),
                "bwd": functools.partial(softmax_module._backward, dy, y, 1.0),
            }
            for stage, fn in stages.items():
                nbytes = softmax_bytes(shape, dtype.itemsize, stage)
                try:
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    result = {"ms": ms, "gbps": nbytes / ms / 1e6}
                except Exception as error:  # registers or shared memory exhausted
                    result = {"error": str(error)[:200]}
                record = {"stage": stage, "shape": list(shape), "dtype": str(dtype)[6:], "block": block, "warps": warps}
                print(json.dumps({**record, **result}), flush=True)
    softmax_module.tiles = default


if __name__ == "__main__":
    main()
