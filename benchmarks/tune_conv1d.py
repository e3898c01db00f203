"""Sweep the tile shape and warps of part 1 of the causal conv1d backward (dz and the weight and bias
gradients) on the `fastlm bench conv1d` shapes. Prints one JSON line per configuration on stdout with
the median ms and the GB/s of the minimum-bytes model, and at the end, on stderr, the best
configuration (the geometric mean of the ms over the shapes) as a `Conv1dConfig(...)` expression
for the table in fastlm/ops/causal_conv1d.py.
Usage: python benchmarks/tune_conv1d.py > tune_conv1d.jsonl
"""

import dataclasses
import functools
import itertools
import json
import math
import sys

import torch
import triton.testing

from fastlm.bench.conv1d import GPU_CASES, conv1d_bytes
from fastlm.ops import causal_conv1d as conv
from fastlm.ops.common import device_arch


def main():
    device = torch.device("cuda")
    log_ms: dict[conv.Conv1dConfig, list[float]] = {}
    for shape, k, dtype in GPU_CASES:
        default = conv.causal_conv1d_config(device_arch(device), dtype)
        u = torch.randn(shape, device=device, dtype=dtype)
        weight = torch.randn(shape[2], k, device=device, dtype=dtype) / k
        bias = torch.randn(shape[2], device=device, dtype=dtype)
        dout = torch.randn_like(u)
        nbytes = conv1d_bytes(shape, k, u.element_size(), "bwd")
        for block_l, block_d, warps, chunk in itertools.product((16, 32, 64), (32, 64, 128), (2, 4, 8), (512,)):
            config = dataclasses.replace(
                default,
                backward_block_l=block_l,
                backward_block_d=block_d,
                backward_warps=warps,
                backward_chunk_l=chunk,
            )
            backward = functools.partial(conv._backward, dout, u, weight, bias, True, True, True, config)
            try:
                ms = triton.testing.do_bench(backward, warmup=25, rep=100, return_mode="median")
                result = {"ms": ms, "gbps": nbytes / ms / 1e6}
                log_ms.setdefault(config, []).append(math.log(ms))
            except Exception as error:  # a configuration that does not compile (registers, shared memory)
                result = {"error": str(error)[:200]}
                log_ms[config] = [math.inf]  # a configuration that fails anywhere is never the best
            record = {"block_l": block_l, "block_d": block_d, "warps": warps, "chunk": chunk}
            print(json.dumps({"shape": list(shape), "k": k, "dtype": str(dtype)[6:], **record, **result}), flush=True)
    best = min(log_ms, key=lambda config: sum(log_ms[config]) / len(log_ms[config]))
    print(f"best (geometric mean of the ms): {best!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
