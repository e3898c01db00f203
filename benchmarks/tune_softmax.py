"""Sweep the chunk width and warps of the looped (long-row) masked-softmax kernels, and the
backward's programs per SM.

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

BLOCKS, WARPS = (4096, 8192, 16384), (8, 16, 32)
BACKWARD_PROGRAMS_PER_SM = (0, 1, 2, 4)  # 0: one program per row
DTYPE_SIZES = {"bfloat16": 2, "float32": 4}


def _looped(block, warps, sk):
    return RowTiles(1, block, False, warps)


def main():
    default = softmax_module.tiles, softmax_module.LOOPED_BACKWARD_PROGRAMS_PER_SM
    long_rows = [shape for shape in GPU_SHAPES if shape[-1] > softmax_module.BLOCK_MAX]
    for shape, dtype in itertools.product(long_rows, (torch.bfloat16, torch.float32)):
        x = torch.randn(shape, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for block, warps in itertools.product(BLOCKS, WARPS):
            softmax_module.tiles = functools.partial(_looped, block, warps)
            y = softmax_module._forward(x, None, 1.0, False)
            config = {"shape": list(shape), "dtype": str(dtype)[6:], "block": block, "warps": warps}
            report("fwd", config, functools.partial(softmax_module._forward, x, None, 1.0, False))
            for per_sm in BACKWARD_PROGRAMS_PER_SM:
                softmax_module.LOOPED_BACKWARD_PROGRAMS_PER_SM = per_sm
                report("bwd", {**config, "per_sm": per_sm}, functools.partial(softmax_module._backward, dy, y, 1.0))
    softmax_module.tiles, softmax_module.LOOPED_BACKWARD_PROGRAMS_PER_SM = default


def report(stage, config, fn):
    nbytes = softmax_bytes(tuple(config["shape"]), DTYPE_SIZES[config["dtype"]], stage)
    try:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        result = {"ms": ms, "gbps": nbytes / ms / 1e6}
    except Exception as error:  # registers or shared memory exhausted
        result = {"error": str(error)[:200]}
    print(json.dumps({"stage": stage, **config, **result}), flush=True)


if __name__ == "__main__":
    main()
