"""The memory-bound kernels at their large benchmark shapes, forward and backward launchers called
once each inside an NVTX range "measure", for Nsight Compute: DRAM bytes against each op's
minimum-bytes model, L2 bytes, time, registers and occupancy say whether a kernel is bandwidth-,
latency- or instruction-bound. The launchers are called directly, not through autograd, whose
backward runs on another thread than the NVTX range.

Usage (writes one CSV row per kernel and metric):
  ncu --clock-control none --nvtx --nvtx-include "measure/" --csv --metrics \\
      gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,\\
launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size \\
      python3 benchmarks/ncu_memory_bound.py > ncu.csv
  python3 benchmarks/ncu_memory_bound.py --summary ncu.csv > ncu.md   # one table row per kernel
"""

import csv
import re
import sys

import torch

from fastlm.ops import causal_conv1d as conv_module
from fastlm.ops import layer_norm as norm_module
from fastlm.ops import masked_softmax as softmax_module


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _norm(m, d):
    x, w, b = _randn(m, d), _randn(d), _randn(d)
    _, mean, rstd = norm_module._forward(x, w, b, 1e-5, False, x.dtype)
    return lambda: (
        norm_module._forward(x, w, b, 1e-5, False, x.dtype),
        norm_module._backward(torch.ones_like(x), x, w, mean, rstd, False, True, True),
    )


def _softmax(shape):
    x = _randn(*shape)
    y = softmax_module._forward(x, None, 1.0, False)
    return lambda: (softmax_module._forward(x, None, 1.0, False), softmax_module._backward(torch.ones_like(y), y, 1.0))


def _conv(shape, k, dtype):
    u, w, b = _randn(*shape, dtype=dtype), _randn(shape[-1], k, dtype=dtype), _randn(shape[-1], dtype=dtype)
    return lambda: (
        conv_module._forward(u, w, b, True),
        conv_module._backward(torch.ones_like(u), u, w, b, True, True, True),
    )


CASES = {
    "layer_norm 4096x16384 bf16": lambda: _norm(4096, 16384),
    "layer_norm 32768x1024 bf16": lambda: _norm(32768, 1024),
    "masked_softmax 1x16x128x65536 bf16": lambda: _softmax((1, 16, 128, 65536)),
    "causal_conv1d+silu 8x4096x2048 K=4 bf16": lambda: _conv((8, 4096, 2048), 4, torch.bfloat16),
    "causal_conv1d+silu 1x8192x8192 K=3 fp16": lambda: _conv((1, 8192, 8192), 3, torch.float16),
}


def summary(path: str) -> str:
    """A markdown table of an ncu CSV from the command above: per fastlm kernel, its case (NVTX
    range), time, DRAM bytes and the bandwidth they imply, L2 bytes, registers and occupancy."""
    with open(path) as f:
        rows = [row for row in csv.reader(f) if row]
    header = next(row for row in rows if row[0] == "ID")
    kernels: dict[str, dict] = {}
    for row in rows:
        if row[0] == "ID" or len(row) != len(header):
            continue
        record = dict(zip(header, row, strict=True))
        if not record["Kernel Name"].startswith("_"):  # PyTorch's own kernels (torch.ones_like)
            continue
        ranges = re.findall(r"<default domain>:([^:]+):", record[header[4]])
        case = ranges[-1] if ranges else ""
        kernel = kernels.setdefault(record["ID"], {"case": case, "kernel": record["Kernel Name"]})
        kernel[record["Metric Name"]] = float(record["Metric Value"].replace(",", ""))
    lines = [
        "| case | kernel | us | DRAM read MB | DRAM written MB | DRAM GB/s | L2 MB | registers | occupancy % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in kernels.values():
        us = k["gpu__time_duration.sum"] / 1e3
        read, written = k["dram__bytes_read.sum"] / 1e6, k["dram__bytes_write.sum"] / 1e6
        gbps = (read + written) / us * 1e3
        lines.append(
            f"| {k['case']} | {k['kernel']} | {us:.1f} | {read:.0f} | {written:.0f} | {gbps:,.0f} "
            f"| {k['lts__t_bytes.sum'] / 1e6:,.0f} | {k['launch__registers_per_thread']:.0f} "
            f"| {k['sm__warps_active.avg.pct_of_peak_sustained_active']:.0f} |"
        )
    return "\n".join(lines) + "\n"


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
    if sys.argv[1:2] == ["--summary"]:
        print(summary(sys.argv[2]), end="")
    else:
        main()
