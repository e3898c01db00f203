"""Sweep the tile shape and warps of part 1 of the causal conv1d backward (dz and the weight and bias
gradients) on the `fastlm bench conv1d` shapes. Prints one JSON line per configuration with the
median ms and the GB/s of the minimum-bytes model; the constants at the top of
fastlm/ops/causal_conv1d.py come from these runs.
Usage: python benchmarks/tune_conv1d.py > tune_conv1d.jsonl
"""

import functools
import itertools
import json

import torch
import triton.testing

from fastlm.bench.conv1d import GPU_CASES, conv1d_bytes
from fastlm.ops import causal_conv1d as conv


def main():
    for shape, k, dtype in GPU_CASES:
        u = torch.randn(shape, device="cuda", dtype=dtype)
        weight = torch.randn(shape[2], k, device="cuda", dtype=dtype) / k
        bias = torch.randn(shape[2], device="cuda", dtype=dtype)
        dout = torch.randn_like(u)
        nbytes = conv1d_bytes(shape, k, u.element_size(), "bwd")
        for block_l, block_d, warps, chunk in itertools.product((16, 32, 64), (32, 64, 128), (2, 4, 8), (512,)):
            conv.BACKWARD_BLOCK_L, conv.BACKWARD_BLOCK_D, conv.BACKWARD_WARPS = block_l, block_d, warps
            conv.BACKWARD_CHUNK_L = chunk
            config = {"block_l": block_l, "block_d": block_d, "warps": warps, "chunk": chunk}
            backward = functools.partial(conv._backward, dout, u, weight, bias, True, True, True)
            try:
                ms = triton.testing.do_bench(backward, warmup=25, rep=100, return_mode="median")
                result = {"ms": ms, "gbps": nbytes / ms / 1e6}
            except Exception as error:  # a configuration that does not compile (registers, shared memory)
                result = {"error": str(error)[:200]}
            print(json.dumps({"shape": list(shape), "k": k, "dtype": str(dtype)[6:], **config, **result}), flush=True)


if __name__ == "__main__":
    main()
