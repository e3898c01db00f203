"""Sweep the chunk width and warps of the looped (long-row) masked-softmax kernels.

Rows wider than `SoftmaxConfig.block_max` take two passes over chunks of that width; the chunk
width sets the registers per program, so how many programs share an SM, so how many rows are read
at once and whether a row's second pass still finds it in L2. The long-row shapes of `fastlm bench
softmax`, bf16 and fp32; one JSON line per configuration on stdout with the median ms and the GB/s
of the minimum-bytes model, and at the end, on stderr, the best configuration (the geometric mean
of the ms of every shape, dtype and direction) as a `SoftmaxConfig(...)` expression for the table
in fastlm/ops/masked_softmax.py.
Usage: python benchmarks/tune_softmax.py > tune_softmax.jsonl
"""

import dataclasses
import functools
import itertools
import json
import math
import sys

import torch
import triton.testing

from fastlm.bench.softmax import GPU_SHAPES, softmax_bytes
from fastlm.ops import masked_softmax as softmax_module
from fastlm.ops.common import device_arch


def main():
    device = torch.device("cuda")
    default = softmax_module.masked_softmax_config(device_arch(device), torch.bfloat16)
    long_rows = [shape for shape in GPU_SHAPES if shape[-1] > default.block_max]
    log_ms: dict[softmax_module.SoftmaxConfig, list[float]] = {}
    for shape, dtype in itertools.product(long_rows, (torch.bfloat16, torch.float32)):
        x = torch.randn(shape, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        for block, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
            config = dataclasses.replace(default, block_max=block, looped_warps=warps)
            forward = functools.partial(softmax_module._forward, x, None, 1.0, False, config)
            for stage in ("fwd", "bwd"):
                nbytes = softmax_bytes(shape, dtype.itemsize, stage)
                try:
                    fn = forward
                    if stage == "bwd":  # timed on this configuration's forward output
                        fn = functools.partial(softmax_module._backward, dy, forward(), 1.0, config)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    result = {"ms": ms, "gbps": nbytes / ms / 1e6}
                    log_ms.setdefault(config, []).append(math.log(ms))
                except Exception as error:  # registers or shared memory exhausted
                    result = {"error": str(error)[:200]}
                    log_ms[config] = [math.inf]  # a configuration that fails anywhere is never the best
                record = {"stage": stage, "shape": list(shape), "dtype": str(dtype)[6:], "block": block, "warps": warps}
                print(json.dumps({**record, **result}), flush=True)
    best = min(log_ms, key=lambda config: sum(log_ms[config]) / len(log_ms[config]))
    print(f"best (geometric mean of the ms): {best!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
