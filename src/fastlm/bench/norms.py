"""`fastlm bench norms`: LayerNorm and RMSNorm forward, backward and fwd+bwd for every implementation.

Protocol (one run, one device, all baselines side by side): x (M, D) ~ N(0, 1) with requires_grad,
weight (and bias for LayerNorm) requiring grad, an upstream gradient of ones' shape drawn once;
fwd is the call as in training, bwd is `y.backward(dy)` after an untimed forward (CUDA events
around the backward only), fwd+bwd both. GB/s use the minimum bytes of `norm_bytes` for every
implementation, so they compare like effective bandwidths against the measured copy bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import fastlm
from fastlm.bench.records import append_records, latest_run, read_records, with_environment
from fastlm.bench.report import grouped_bar_plot, markdown_table
from fastlm.bench.timing import is_out_of_memory, measure, measure_after_setup

RESULTS_FILE = "norms.jsonl"
KINDS = ("layer", "rms")
GPU_SHAPES = ((32768, 1024), (16384, 4096), (4096, 16384))
GPU_DTYPES = (torch.bfloat16, torch.float32)
CPU_SHAPES = ((64, 256),)  # reduced run on machines without a GPU

NormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def norm_bytes(rows: int, width: int, element_size: int, kind: str, stage: str) -> int:
    """Minimum bytes moved: x, y, dy, dx once each in the activations' dtype; the forward reads the
    (D,) weight (and bias), the backward reads the weight and writes its gradient (and the bias's);
    mean / rstd in fp32 written by the forward and read by the backward (rstd only for RMSNorm)."""
    params = 1 if kind == "rms" else 2
    stats = 4 * rows * (1 if kind == "rms" else 2)
    forward = 2 * rows * width * element_size + params * width * element_size + stats
    backward = 3 * rows * width * element_size + (1 + params) * width * element_size + stats
    return {"fwd": forward, "bwd": backward, "fwd_bwd": forward + backward}[stage]


@dataclass(frozen=True)
class Implementation:
    name: str
    needs_gpu: bool
    make: Callable[[str], NormFn | str]  # the norm function for a kind, or why it is unavailable


def _eager(kind: str) -> NormFn:
    if kind == "layer":
        return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)
    return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps=1e-5)


def _compiled(kind: str) -> NormFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(kind), dynamic=False)


def _fastlm(kind: str) -> NormFn:
    if kind == "layer":
        return lambda x, w, b: fastlm.layer_norm(x, w, b)
    return lambda x, w, b: fastlm.rms_norm(x, w)


def _liger(kind: str) -> NormFn | str:
    try:
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm
    except ImportError:
        return "missing: liger-kernel is not installed"
    if kind == "layer":
        return lambda x, w, b: liger_layer_norm(x, w, b, 1e-5)
    return lambda x, w, b: liger_rms_norm(x, w, 1e-5, in_place=False)


IMPLEMENTATIONS = (
    Implementation("eager", False, _eager),
    Implementation("compile", True, _compiled),
    Implementation("fastlm", False, _fastlm),
    Implementation("liger", True, _liger),
)


def _measure_one(impl, kind, rows, width, dtype, device, ceilings) -> dict:
    if impl.needs_gpu and device.type != "cuda":
        return {"status": "needs a GPU"}
    fn = impl.make(kind)
    if isinstance(fn, str):
        return {"status": fn}
    x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(width, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(width, device=device, dtype=dtype, requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (x, w, b) if t is not None]
    dy = torch.randn(rows, width, device=device, dtype=dtype)

    def forward_fresh_graph():
        for t in leaves:
            t.grad = None
        return fn(x, w, b)

    try:
        stages = {
            "fwd": measure(lambda: fn(x, w, b), device),
            "bwd": measure_after_setup(
                forward_fresh_graph, lambda y: y.backward(dy), device, reps=40 if device.type == "cuda" else 5
            ),
            "fwd_bwd": measure(lambda: fn(x, w, b).backward(dy), device, grad_to_none=leaves),
        }
    except RuntimeError as error:
        if is_out_of_memory(error):
            return {"status": "OOM"}
        return {"status": f"error: {str(error).splitlines()[0][:120]}"}
    result: dict = {"status": "ok"}
    for stage, timing in stages.items():
        gbps = norm_bytes(rows, width, x.element_size(), kind, stage) / (timing.median_ms * 1e-3) / 1e9
        result.update({f"{stage}_ms": timing.median_ms, f"{stage}_gbps": gbps,
                       f"{stage}_fraction_of_copy": gbps / ceilings["copy_gbps"]})  # fmt: skip
    return result


def cases(device: torch.device) -> list[tuple[str, int, int, torch.dtype]]:
    if device.type == "cuda":
        return [(k, m, d, t) for k in KINDS for (m, d) in GPU_SHAPES for t in GPU_DTYPES]
    return [(k, m, d, torch.float32) for k in KINDS for (m, d) in CPU_SHAPES]


def run(device: torch.device, ceilings: dict, results_dir: Path, progress=lambda done: None) -> list[dict]:
    records = []
    for kind, rows, width, dtype in cases(device):
        for impl in IMPLEMENTATIONS:
            record = {"op": "norms", "kind": kind, "rows": rows, "width": width,
                      "dtype": str(dtype).removeprefix("torch."), "implementation": impl.name,
                      "copy_gbps_measured": ceilings["copy_gbps"]}  # fmt: skip
            record.update(_measure_one(impl, kind, rows, width, dtype, device, ceilings))
            records.append(with_environment(record))
            progress(f"{kind} {rows}x{width} {record['dtype']} {impl.name}")
    append_records(results_dir / RESULTS_FILE, records)
    return records


COLUMNS = [("kind", "norm"), ("shape", "M x D"), ("dtype", "dtype"), ("implementation", "implementation"),
           ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"), ("fwd_gbps", "fwd GB/s"),
           ("fwd_percent_of_copy", "fwd % of copy"), ("fwd_bwd_gbps", "fwd+bwd GB/s"),
           ("fwd_bwd_percent_of_copy", "fwd+bwd % of copy"), ("status", "status")]  # fmt: skip


def render(results_dir: Path, reports_dir: Path) -> str:
    records = latest_run(read_records(results_dir / RESULTS_FILE))
    if not records:
        return "No norm records yet: run `fastlm bench norms`.\n"
    rows = []
    for r in records:
        row = {**r, "shape": f"{r['rows']}x{r['width']}"}
        if r["status"] == "ok":
            row["fwd_percent_of_copy"] = 100 * r["fwd_fraction_of_copy"]
            row["fwd_bwd_percent_of_copy"] = 100 * r["fwd_bwd_fraction_of_copy"]
        rows.append(row)
    groups = list(dict.fromkeys(f"{r['kind']} {r['shape']} {r['dtype']}" for r in rows))
    series = {
        impl.name: [next((r.get("fwd_bwd_gbps") for r in rows if f"{r['kind']} {r['shape']} {r['dtype']}" == g
                          and r["implementation"] == impl.name), None) for g in groups]
        for impl in IMPLEMENTATIONS
    }  # fmt: skip
    first = records[0]
    plot = grouped_bar_plot(reports_dir / "norms_fwd_bwd_gbps.png", groups, series,
                            ylabel="fwd+bwd GB/s (minimum bytes)",
                            title=f"LayerNorm / RMSNorm fwd+bwd bandwidth ({first['gpu']})",
                            reference_line=(first["copy_gbps_measured"], "measured copy"))  # fmt: skip
    return "\n\n".join([
        f"Device: {first['gpu']} · torch {first['torch']} · triton {first['triton']} · git {first['git_sha']} · "
        f"{first['date']} · measured copy bandwidth {first['copy_gbps_measured']:.0f} GB/s",
        markdown_table(rows, COLUMNS),
        f"![fwd+bwd bandwidth]({plot.name})",
    ])  # fmt: skip
