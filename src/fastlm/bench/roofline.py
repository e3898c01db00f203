"""`fastlm bench roofline`: the device's roofline from its measured ceilings, with every benchmarked
fastlm kernel placed on it (forward pass, from the latest records of the same device).

Roofs: memory, the copy bandwidth measured by `fastlm bench ceilings` times the intensity; compute,
the measured matmul rate (bf16 on the tensor cores of a GPU, fp32 on a CPU) and the datasheet fp32
rate of the CUDA cores, where elementwise math runs. A kernel's point: x = FLOPs / minimum bytes
(its cost model), y = FLOPs / measured time (norms, softmax, conv1d: of the forward replayed as a
CUDA graph where the run has it). FLOPs per element of the memory-bound ops, counting add, mul,
exp, div as 1: LayerNorm 7 (mean, centre, square-and-add, scale, weight, bias), RMSNorm 4, masked
softmax 6 (scale, mask, shift, exp, sum, divide), conv1d from `fastlm.analysis.conv1d`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.analysis.conv1d import Conv1dCost
from fastlm.analysis.xent import CrossEntropyCost
from fastlm.devices import current_device_name, spec_for_device_name
from fastlm.harness.benchmark import Benchmark
from fastlm.harness.ceilings import latest_ceilings, record_ceilings
from fastlm.utils.plots import save_figure
from fastlm.utils.records import latest_run, read_records
from fastlm.utils.tables import markdown_table

NORM_FLOPS_PER_ELEMENT = {"layer": 7, "rms": 4}
CPU_NOTE = (
    "No GPU: this roofline places the kernels' CPU reference-path timings under the CPU's measured copy "
    "bandwidth and fp32 matmul rate; it says nothing about the Triton kernels on a GPU."
)
SOFTMAX_FLOPS_PER_ELEMENT = 6


@dataclass(frozen=True)
class Point:
    kernel: str
    case: str
    flops: float
    bytes: float
    seconds: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12


def _bytes_moved(record: dict) -> float:
    """The minimum bytes of a bandwidth record's forward: its GB/s times its time."""
    return record["fwd_gbps"] * 1e9 * record["fwd_ms"] * 1e-3


def _kernel_seconds(record: dict) -> float:
    """A bandwidth record's forward time: of its CUDA-graph replay where measured (the kernels
    without the host's dispatch, which a small op can wait on), else of the eager call."""
    return record.get("fwd_graph_ms", record["fwd_ms"]) * 1e-3


def _norm_points(records):
    for r in records:
        elements = r["rows"] * r["width"]
        flops = NORM_FLOPS_PER_ELEMENT[r["kind"]] * elements
        yield Point(
            f"{r['kind']} norm", f"{r['rows']}x{r['width']} {r['dtype']}", flops, _bytes_moved(r), _kernel_seconds(r)
        )


def _softmax_points(records):
    for r in records:
        elements = math.prod(int(n) for n in r["shape"].split("x"))
        yield Point(
            "masked softmax",
            f"{r['shape']} {r['dtype']}",
            SOFTMAX_FLOPS_PER_ELEMENT * elements,
            _bytes_moved(r),
            _kernel_seconds(r),
        )


def _conv1d_points(records):
    for r in records:
        shape = tuple(int(n) for n in r["shape"].split("x"))
        cost = Conv1dCost(*shape, r["kernel_size"], 2 if r["dtype"] != "float32" else 4, bias=True, silu=True)
        yield Point(
            "causal conv1d",
            f"{r['shape']} K={r['kernel_size']} {r['dtype']}",
            cost.fwd_flops,
            cost.fwd_bytes,
            _kernel_seconds(r),
        )


def _xent_points(records):
    for r in records:
        cost = CrossEntropyCost(r["batch"], r["vocab"])
        yield Point("cross-entropy", f"{r['batch']}x{r['vocab']}", cost.fwd_flops, cost.fwd_bytes, r["fwd_ms"] * 1e-3)


def _attention_points(records):
    for r in records:
        b, h, s, d = r["batch"], r["heads"], r["seq"], r["head_dim"]
        flops = r["fwd_tflops"] * 1e12 * r["fwd_ms"] * 1e-3
        element_size = 4 if r["dtype"] == "float32" else 2
        yield Point(
            "flash attention",
            f"B{b} H{h} S{s} D{d} {r['dtype']}",
            flops,
            4 * b * h * s * d * element_size,
            r["fwd_ms"] * 1e-3,
        )  # q, k, v read, o written


SOURCES = {
    "norms.jsonl": _norm_points,
    "softmax.jsonl": _softmax_points,
    "conv1d.jsonl": _conv1d_points,
    "xent.jsonl": _xent_points,
    "attention.jsonl": _attention_points,
}


def kernel_points(results_dir: Path, gpu: str) -> list[Point]:
    """fastlm's kernels from the latest run of each benchmark measured on ``gpu``."""
    points = []
    for name, to_points in SOURCES.items():
        records = [r for r in read_records(results_dir / name) if r.get("gpu") == gpu]
        chosen = [r for r in latest_run(records) if r.get("implementation") == "fastlm" and r.get("status") == "ok"]
        points += list(to_points(chosen))
    return points


def plot_roofline(path: Path, ceilings: dict, vector_tflops: float | None, points: list[Point]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidth, matmul = ceilings["copy_gbps"] * 1e9, ceilings["matmul_tflops"] * 1e12
    ridges = [matmul / bandwidth] + ([vector_tflops * 1e12 / bandwidth] if vector_tflops else [])
    intensities = sorted([2.0**e for e in range(-4, 12)] + ridges)  # the ridges too, so the corners are sharp
    fig, ax = plt.subplots(figsize=(9, 6))
    measured = f"measured: copy {ceilings['copy_gbps']:.3g} GB/s, {_matmul(ceilings)}"
    ax.plot(intensities, [min(i * bandwidth, matmul) / 1e12 for i in intensities], color="black", label=measured)
    if vector_tflops:
        ax.plot(
            intensities,
            [min(i * bandwidth / 1e12, vector_tflops) for i in intensities],
            color="gray",
            linestyle="--",
            label=f"CUDA-core fp32 roof (datasheet {vector_tflops:.0f} TF/s)",
        )
    markers = dict(zip(sorted({p.kernel for p in points}), "osD^vP*X", strict=False))
    for kernel, marker in markers.items():
        mine = [p for p in points if p.kernel == kernel]
        ax.scatter([p.intensity for p in mine], [p.tflops for p in mine], marker=marker, s=40, label=kernel, zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, minimum bytes)")
    ax.set_ylabel("attained TFLOP/s (forward)")
    ax.set_title(f"Roofline · {ceilings['gpu']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path, dpi=120)


def _matmul(ceilings: dict) -> str:
    """The measured matmul rate with its dtype (bf16 on a GPU, fp32 on a CPU)."""
    return f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_tflops']:.3g} TFLOP/s"


def render_roofline(results_dir: Path, reports_dir: Path, ceilings: dict) -> str:
    """The roofline of ``ceilings``' device with the kernels measured there; writes roofline.png."""
    points = kernel_points(results_dir, ceilings["gpu"])
    spec = spec_for_device_name(ceilings["gpu"])
    plot = plot_roofline(reports_dir / "roofline.png", ceilings, spec.vector_fp32_tflops if spec else None, points)
    bandwidth, matmul = ceilings["copy_gbps"] * 1e9, ceilings["matmul_tflops"] * 1e12
    rows = [
        {
            "kernel": p.kernel,
            "case": p.case,
            "intensity": p.intensity,
            "tflops": p.tflops,
            "roof": min(p.intensity * bandwidth, matmul) / 1e12,
            "percent": 100 * p.tflops * 1e12 / min(p.intensity * bandwidth, matmul),
            "bound": "memory" if p.intensity * bandwidth < matmul else "compute",
        }
        for p in points
    ]
    columns = [
        ("kernel", "kernel"),
        ("case", "case"),
        ("intensity", "FLOP/B"),
        ("tflops", "TFLOP/s"),
        ("roof", "roof TFLOP/s"),
        ("percent", "% of roof"),
        ("bound", "under the"),
    ]
    return "\n\n".join(
        [
            f"Device: {ceilings['gpu']} · ceilings measured {ceilings['date']} (git {ceilings['git_sha']}): copy "
            f"{ceilings['copy_gbps']:.3g} GB/s, {_matmul(ceilings)} · kernels: the latest fastlm forward records "
            "of this device",
            *([CPU_NOTE] if ceilings["gpu"] == "cpu" else []),
            markdown_table(rows, columns)
            if rows
            else "No kernel records of this device yet: run the `fastlm bench` ops.",
            f"![roofline]({plot.name})",
        ]
    )


class RooflineBenchmark(Benchmark):
    """Measures nothing of its own: places the other benchmarks' latest records of this device under
    its latest ceilings (measured now if it has none)."""

    name = "roofline"
    title = "Roofline"
    cpu_note = CPU_NOTE

    def ceilings(self, results_dir: Path, device: torch.device) -> dict:
        return latest_ceilings(results_dir, current_device_name()) or record_ceilings(
            results_dir, device, complete=False
        )

    def cases(self, device: torch.device) -> list:
        return []

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        return render_roofline(results_dir, reports_dir, latest_ceilings(results_dir, current_device_name()))
