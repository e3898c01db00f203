"""Measured ceilings of the device at hand: copy bandwidth and matrix-multiply rate.

Benchmarks report achieved GB/s or TFLOP/s as a fraction of these (what the card really does)
and of the datasheet (fastlm.devices).

- copy: ``dst.copy_(src)`` of 1 GiB (GPU) / 64 MiB (CPU) buffers; bytes = read + write.
- matmul: 8192^3 bf16 product on random data (GPU) / 1024^3 fp32 (CPU); 2 M N K FLOPs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastlm.devices import current_device_name, spec_for_device_name
from fastlm.harness.timing import measure
from fastlm.utils.records import append_records, read_records, with_environment

RESULTS_FILE = "ceilings.jsonl"


def _time_copy(nbytes: int, device: torch.device):
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), device)


def measure_ceilings(device: torch.device) -> dict:
    on_gpu = device.type == "cuda"
    copy_bytes = (1 << 30) if on_gpu else (64 << 20)
    copy = _time_copy(copy_bytes, device)

    n = 8192 if on_gpu else 1024
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = measure(lambda: a @ b, device)

    record = {
        "op": "ceilings",
        "copy_gbps": 2 * copy_bytes / (copy.median_ms * 1e-3) / 1e9,
        "copy_bytes": copy_bytes,
        "matmul_tflops": 2 * n**3 / (matmul.median_ms * 1e-3) / 1e12,
        "matmul_shape": [n, n, n],
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }
    spec = spec_for_device_name(current_device_name())
    if spec is not None:
        record["copy_fraction_of_datasheet"] = record["copy_gbps"] / spec.memory_gbps
        record["matmul_fraction_of_datasheet"] = record["matmul_tflops"] / spec.matmul_tflops
    return with_environment(record)


def record_ceilings(results_dir: Path, device: torch.device, *, complete: bool = True) -> dict:
    """Measure the ceilings now (every benchmark run does, so ratios stay within one run). A
    benchmark's run records them with ``complete`` False, and the runner marks them complete with
    its other records when it ends: an interrupted run's ceilings never become the latest."""
    record = {**measure_ceilings(device), "complete": complete}
    append_records(results_dir / RESULTS_FILE, [record])
    return record


def latest_ceilings(results_dir: Path, gpu: str) -> dict | None:
    """The last complete ceilings recorded on ``gpu`` (a device name), or None."""
    here = [r for r in read_records(results_dir / RESULTS_FILE) if r["gpu"] == gpu]
    return here[-1] if here else None
