"""`fastlm bench norms`: LayerNorm and RMSNorm forward, backward and fwd+bwd for every implementation.

x (M, D) ~ N(0, 1), weight (and bias for LayerNorm), all requiring grad; the protocol and the GB/s
convention are `fastlm.bench.bandwidth`'s, with the minimum bytes of `norm_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import fastlm
from fastlm.bench.bandwidth import STAGES, Implementation, measure_stages, render_bandwidth
from fastlm.harness.records import append_records, latest_run, read_records, with_environment

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
    stage_bytes = {stage: norm_bytes(rows, width, x.element_size(), kind, stage) for stage in STAGES}
    return measure_stages(fn, (x, w, b), torch.randn_like(x), stage_bytes, ceilings["copy_gbps"], device)


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


def render(results_dir: Path, reports_dir: Path) -> str:
    records = latest_run(read_records(results_dir / RESULTS_FILE))
    if not records:
        return "No norm records yet: run `fastlm bench norms`.\n"
    for r in records:
        r["shape"] = f"{r['rows']}x{r['width']}"
    columns = [("kind", "norm"), ("shape", "M x D"), ("dtype", "dtype")]
    plot = reports_dir / "norms_fwd_bwd_gbps.png"
    return render_bandwidth(records, columns, lambda r: f"{r['kind']} {r['shape']} {r['dtype']}", plot,
                            "LayerNorm / RMSNorm fwd+bwd bandwidth")  # fmt: skip
