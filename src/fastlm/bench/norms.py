"""`fastlm bench norms`: LayerNorm and RMSNorm forward, backward and fwd+bwd for every implementation.

x (M, D) ~ N(0, 1), weight (and bias for LayerNorm), all requiring grad; the protocol and the GB/s
convention are `fastlm.bench.bandwidth`'s, with the minimum bytes of `norm_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastlm
from fastlm.bench.bandwidth import STAGES, BandwidthBenchmark, measure_stages
from fastlm.harness.benchmark import Implementation, Run

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
class Case:
    kind: str  # layer | rms
    rows: int
    width: int
    dtype: torch.dtype


def _eager(case: Case) -> NormFn:
    if case.kind == "layer":
        return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)
    return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps=1e-5)


def _compiled(case: Case) -> NormFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(case), dynamic=False)


def _fastlm(case: Case) -> NormFn:
    if case.kind == "layer":
        return lambda x, w, b: fastlm.layer_norm(x, w, b)
    return lambda x, w, b: fastlm.rms_norm(x, w)


def _liger(case: Case) -> NormFn | str:
    try:
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm
    except ImportError:
        return "missing: liger-kernel is not installed"
    if case.kind == "layer":
        return lambda x, w, b: liger_layer_norm(x, w, b, 1e-5)
    return lambda x, w, b: liger_rms_norm(x, w, 1e-5, in_place=False)


IMPLEMENTATIONS = (
    Implementation("eager", _eager),
    Implementation("compile", _compiled, needs_gpu=True),
    Implementation("fastlm", _fastlm),
    Implementation("liger", _liger, needs_gpu=True),
)


class NormsBenchmark(BandwidthBenchmark):
    name = "norms"
    title = "LayerNorm / RMSNorm benchmark"
    progress_name = "norms"
    case_columns = (("kind", "norm"), ("shape", "M x D"), ("dtype", "dtype"))
    plot_title = "LayerNorm / RMSNorm fwd+bwd bandwidth"
    empty_report = "No norm records yet: run `fastlm bench norms`.\n"

    def cases(self, device: torch.device) -> list[Case]:
        if device.type == "cuda":
            return [Case(k, m, d, t) for k in KINDS for (m, d) in GPU_SHAPES for t in GPU_DTYPES]
        return [Case(k, m, d, torch.float32) for k in KINDS for (m, d) in CPU_SHAPES]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def case_fields(self, case: Case) -> dict:
        return {
            "op": "norms",
            "kind": case.kind,
            "rows": case.rows,
            "width": case.width,
            "dtype": str(case.dtype).removeprefix("torch."),
        }

    def case_label(self, record: dict) -> str:
        return f"{record['kind']} {record['rows']}x{record['width']} {record['dtype']}"

    def shown(self, record: dict) -> dict:
        return {**record, "shape": f"{record['rows']}x{record['width']}"}

    def measure(self, case: Case, fn: NormFn, run: Run) -> dict:
        def leaf(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=run.device, dtype=case.dtype, requires_grad=True)

        x, w = leaf(case.rows, case.width), leaf(case.width)
        b = leaf(case.width) if case.kind == "layer" else None
        stage_bytes = {stage: norm_bytes(case.rows, case.width, x.element_size(), case.kind, stage) for stage in STAGES}
        return measure_stages(fn, (x, w, b), torch.randn_like(x), stage_bytes, run.ceilings["copy_gbps"], run.device)
