"""`fastlm bench swiglu`: SwiGLU's silu(gate) * up forward, backward and fwd+bwd for every implementation.

gate, up (M, D) ~ N(0, 1), both requiring grad; M x D is an MLP's tokens x intermediate size. They
are separate contiguous tensors, which every implementation reads without a copy (Liger's makes
strided inputs, such as the halves of a fused projection, contiguous first). Liger's backward
writes the gradients over its saved gate and up: no allocation, the same bytes. The protocol and
the GB/s convention are `fastlm.bench.bandwidth`'s, with the minimum bytes of `swiglu_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastlm
from fastlm.bench.bandwidth import STAGES, BandwidthBenchmark, measure_stages
from fastlm.harness.benchmark import Implementation, Run

# Batch 4 x 2048 tokens through the MLP of Llama-3.2-1B (intermediate size 8192) and of
# Llama-3.1-8B (14336)
GPU_SHAPES = ((8192, 8192), (8192, 14336))
GPU_DTYPES = (torch.bfloat16,)
CPU_SHAPES = ((64, 256),)  # reduced run on machines without a GPU

SwigluFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu_bytes(rows: int, width: int, element_size: int, stage: str) -> int:
    """Minimum bytes: the forward reads gate and up and writes y; the backward reads dy, gate and up
    and writes both gradients (silu(gate) recomputed, not saved)."""
    elements = rows * width * element_size
    return {"fwd": 3 * elements, "bwd": 5 * elements, "fwd_bwd": 8 * elements}[stage]


@dataclass(frozen=True)
class Case:
    rows: int
    width: int
    dtype: torch.dtype


def _eager(_case=None) -> SwigluFn:
    return lambda gate, up: F.silu(gate) * up


def _compiled(_case: Case) -> SwigluFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(), dynamic=False)


def _fastlm(_case: Case) -> SwigluFn:
    return fastlm.swiglu


def _liger(_case: Case) -> SwigluFn | str:
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return "missing: liger-kernel is not installed"
    return LigerSiLUMulFunction.apply


IMPLEMENTATIONS = (
    Implementation("eager", _eager),
    Implementation("compile", _compiled, needs_gpu=True),
    Implementation("fastlm", _fastlm),
    Implementation("liger", _liger, needs_gpu=True),
)


class SwigluBenchmark(BandwidthBenchmark):
    name = "swiglu"
    title = "SwiGLU benchmark"
    progress_name = "swiglu"
    case_columns = (("shape", "M x D"), ("dtype", "dtype"))
    plot_title = "SwiGLU silu(gate) * up fwd+bwd bandwidth"
    empty_report = "No SwiGLU records yet: run `fastlm bench swiglu`.\n"

    def cases(self, device: torch.device) -> list[Case]:
        if device.type == "cuda":
            return [Case(m, d, t) for (m, d) in GPU_SHAPES for t in GPU_DTYPES]
        return [Case(m, d, torch.float32) for (m, d) in CPU_SHAPES]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def case_fields(self, case: Case) -> dict:
        return {"op": "swiglu", "rows": case.rows, "width": case.width, "dtype": str(case.dtype).removeprefix("torch.")}

    def case_label(self, record: dict) -> str:
        return f"{record['rows']}x{record['width']} {record['dtype']}"

    def shown(self, record: dict) -> dict:
        return {**record, "shape": f"{record['rows']}x{record['width']}"}

    def measure(self, case: Case, fn: SwigluFn, run: Run) -> dict:
        def leaf() -> torch.Tensor:
            return torch.randn(case.rows, case.width, device=run.device, dtype=case.dtype, requires_grad=True)

        gate, up = leaf(), leaf()
        stage_bytes = {stage: swiglu_bytes(case.rows, case.width, gate.element_size(), stage) for stage in STAGES}
        return measure_stages(
            fn, (gate, up), torch.randn_like(gate), stage_bytes, run.ceilings["copy_gbps"], run.device
        )
