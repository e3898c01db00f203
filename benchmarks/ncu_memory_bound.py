"""The memory-bound kernels at their large benchmark shapes, one fwd+bwd each inside an NVTX range
"measure", for Nsight Compute: DRAM bytes against each op's minimum-bytes model, L2 bytes, time,
registers and occupancy say whether a kernel is bandwidth-, latency- or instruction-bound.

Usage (writes one CSV row per kernel and metric):
  ncu --clock-control none --nvtx --nvtx-include "measure/" --csv --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,\
launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size \
      python3 benchmarks/ncu_memory_bound.py > ncu.csv
"""

import torch

import fastlm

CASES = {
    "layer_norm 4096x16384 bf16": lambda: _norm((4096, 16384)),
    "layer_norm 32768x1024 bf16": lambda: _norm((32768, 1024)),
    "masked_softmax 1x16x128x65536 bf16": lambda: _softmax((1, 16, 128, 65536)),
    "causal_conv1d+silu 8x4096x2048 K=4 bf16": lambda: _conv((8, 4096, 2048), 4, torch.bfloat16),
    "causal_conv1d+silu 1x8192x8192 K=3 fp16": lambda: _conv((1, 8192, 8192), 3, torch.float16),
}


def _leaf(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def _norm(shape):
    x, w, b = _leaf(*shape), _leaf(shape[-1]), _leaf(shape[-1])
    return lambda: fastlm.layer_norm(x, w, b).backward(torch.ones_like(x))


def _softmax(shape):
    x = _leaf(*shape)
    return lambda: fastlm.masked_softmax(x).backward(torch.ones_like(x))


def _conv(shape, k, dtype):
    u, w, b = _leaf(*shape, dtype=dtype), _leaf(shape[-1], k, dtype=dtype), _leaf(shape[-1], dtype=dtype)
    return lambda: fastlm.causal_conv1d(u, w, b, activation="silu").backward(torch.ones_like(u))


def main():
    for name, make in CASES.items():
        step = make()
        step()  # compile outside the range
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")
        torch.cuda.nvtx.range_push(name)
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
