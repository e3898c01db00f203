"""`fastlm bench xent`: cross-entropy forward, backward and fwd+bwd for every implementation.

Protocol (one run, one device, all baselines measured side by side):
- inputs: logits (B, V) bf16 ~ N(0, 1) with requires_grad, targets uniform in [0, V);
  reduction='none' and an upstream gradient of ones (what `losses.sum().backward()` gives);
- fwd: the loss call as in training (grad enabled; the fused paths compute dlogits here);
  bwd: `losses.backward(ones)` after an untimed forward (CUDA events around the backward only);
  fwd+bwd: both, as one training step would. The fused path's fwd already writes dlogits, so its
  fwd+bwd adds only the backward's row scaling (one early-exiting launch on a GPU where the upstream
  gradient is 1) and can time within noise of fwd; on a CPU shared with other processes the load
  can also change between the stages. The table says which where fwd+bwd comes out below fwd;
- achieved GB/s use the cost model's bytes (fastlm.analysis.xent) for every implementation, so
  they compare like effective bandwidths: fwd 2BV+16B, bwd 4BV+16B, fwd+bwd their sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import fastlm
from fastlm.analysis.xent import CrossEntropyCost
from fastlm.harness.benchmark import Benchmark, Implementation, Run
from fastlm.harness.timing import Timing, measure, measure_after_setup, noted_status, stage_times
from fastlm.utils.plots import bar_series, grouped_bar_plot
from fastlm.utils.tables import device_line, markdown_table

DEFAULT_BATCH = 4096
DEFAULT_VOCABS = (32000, 50264, 128256)
CPU_BATCH = 128  # reduced run on machines without a GPU


def cpu_note(batch: int) -> str:
    """What a run without a GPU at ``batch`` rows measures and what it does not."""
    return (
        "No GPU: fastlm's cross-entropy runs its plain-PyTorch reference path (the Triton interpreter under "
        f"TRITON_INTERPRET=1), not the Triton kernels, at B={batch}; torch.compile and Liger need a GPU and are "
        "not measured. These CPU timings vary by tens of percent between runs (more when other processes share "
        "the cores) and say nothing about GPU speed."
    )


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Case:
    batch: int
    vocab: int


def _eager(_case=None) -> LossFn:
    return lambda logits, targets: F.cross_entropy(logits, targets, reduction="none")


def _eager_fp32(_case) -> LossFn:
    return lambda logits, targets: F.cross_entropy(logits.float(), targets, reduction="none")


def _compiled(_case) -> LossFn:
    return torch.compile(_eager())


def _fastlm(fused: bool) -> Callable[[Case], LossFn]:
    return lambda _case: lambda logits, targets: fastlm.cross_entropy(logits, targets, reduction="none", fused=fused)


def _liger(_case) -> LossFn | str:
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return "missing: liger-kernel is not installed"
    return lambda logits, targets: liger_cross_entropy(logits, targets, reduction="none")


IMPLEMENTATIONS = (
    Implementation("eager", _eager, "F.cross_entropy on the bf16 logits"),
    Implementation("eager-fp32", _eager_fp32, "F.cross_entropy after an fp32 upcast"),
    Implementation("compile", _compiled, "torch.compile(F.cross_entropy)", needs_gpu=True),
    Implementation("fastlm", _fastlm(False), "fastlm, recompute path (fused=False)"),
    Implementation("fastlm-fused", _fastlm(True), "fastlm, fused path (dlogits in the forward)"),
    Implementation("liger", _liger, "Liger-Kernel cross-entropy", needs_gpu=True),
)


def _time_stages(loss_fn: LossFn, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, Timing]:
    upstream = torch.ones(logits.shape[0], device=logits.device)

    def forward_fresh_graph():
        logits.grad = None
        return loss_fn(logits, targets)

    return {
        "fwd": measure(lambda: loss_fn(logits, targets), logits.device),
        "bwd": measure_after_setup(forward_fresh_graph, lambda losses: losses.backward(upstream), logits.device),
        "fwd_bwd": measure(lambda: loss_fn(logits, targets).backward(upstream), logits.device, grad_to_none=[logits]),
    }


# ---------------------------------------------------------------------------------------------
# Summaries, tables and plots
# ---------------------------------------------------------------------------------------------


def speedups(records: list[dict], baseline: str = "eager") -> dict[str, float]:
    """Geometric-mean fwd+bwd speed-up over ``baseline`` across the vocabularies, per implementation."""
    by_vocab = {r["vocab"]: r for r in records if r["implementation"] == baseline and r["status"] == "ok"}
    ratios: dict[str, list[float]] = {}
    for r in records:
        base = by_vocab.get(r["vocab"])
        if r["status"] == "ok" and base is not None:
            ratios.setdefault(r["implementation"], []).append(base["fwd_bwd_ms"] / r["fwd_bwd_ms"])
    return {name: math.exp(sum(map(math.log, values)) / len(values)) for name, values in ratios.items()}


TABLE_COLUMNS = [
    ("vocab", "V"),
    ("implementation", "implementation"),
    ("fwd_ms", "fwd ms"),
    ("bwd_ms", "bwd ms"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("fwd_gbps", "fwd GB/s"),
    ("fwd_percent_of_copy", "fwd % of copy"),
    ("fwd_bwd_gbps", "fwd+bwd GB/s"),
    ("speedup", "fwd+bwd speed-up vs eager"),
    ("status", "status"),
]


def table_rows(records: list[dict]) -> list[dict]:
    eager = {r["vocab"]: r for r in records if r["implementation"] == "eager" and r["status"] == "ok"}
    rows = []
    for r in records:
        row = dict(r)
        if r["status"] == "ok":
            row["fwd_percent_of_copy"] = 100 * r["fwd_fraction_of_copy"]
            if r["vocab"] in eager:
                row["speedup"] = eager[r["vocab"]]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            row["status"] = noted_status(r)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class CrossEntropyBenchmark(Benchmark):
    """Every implementation at every vocabulary size; ``batch`` None: DEFAULT_BATCH on a GPU, CPU_BATCH
    without one."""

    batch: int | None = None
    vocabs: tuple[int, ...] = DEFAULT_VOCABS

    name = "xent"
    title = "Cross-entropy benchmark"
    progress_name = "cross-entropy"
    measures_ceilings = True

    def batch_on(self, device: torch.device) -> int:
        return self.batch or (DEFAULT_BATCH if device.type == "cuda" else CPU_BATCH)

    def note(self, device: torch.device) -> str | None:
        return cpu_note(self.batch_on(device)) if device.type != "cuda" else None

    def cases(self, device: torch.device) -> list[Case]:
        return [Case(self.batch_on(device), vocab) for vocab in self.vocabs]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def describe(self, case: Case, implementation: Implementation, run: Run) -> dict:
        return {
            "op": "xent",
            "batch": case.batch,
            "vocab": case.vocab,
            "dtype": "bfloat16",
            "reduction": "none",
            "implementation": implementation.name,
            "description": implementation.description,
            "copy_gbps_measured": run.ceilings["copy_gbps"],
        }

    def label(self, case: Case, implementation: Implementation) -> str:
        return f"V={case.vocab} {implementation.name}"

    def measure(self, case: Case, loss_fn: LossFn, run: Run) -> dict:
        logits = torch.randn(case.batch, case.vocab, device=run.device, dtype=torch.bfloat16).requires_grad_(True)
        targets = torch.randint(0, case.vocab, (case.batch,), device=run.device)
        cost = CrossEntropyCost(case.batch, case.vocab)
        stage_bytes = {"fwd": cost.fwd_bytes, "bwd": cost.bwd_bytes, "fwd_bwd": cost.fwd_bytes + cost.bwd_bytes}
        copy_gbps = run.ceilings["copy_gbps"]
        result: dict = {"status": "ok"}
        for stage, timing in _time_stages(loss_fn, logits, targets).items():
            gbps = stage_bytes[stage] / (timing.median_ms * 1e-3) / 1e9
            result.update(
                {
                    **stage_times(stage, timing),
                    f"{stage}_gbps": gbps,
                    f"{stage}_fraction_of_copy": gbps / copy_gbps,
                }
            )
        return result

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown section (tables + plot links) for the latest xent run; writes the PNG plots."""
        records = self.latest_records(results_dir)
        if not records:
            return "No cross-entropy records yet: run `fastlm bench xent`.\n"
        first = records[0]
        names = [impl.name for impl in IMPLEMENTATIONS]
        groups = [f"V={v}" for v in sorted({r["vocab"] for r in records})]

        def series(key):
            return bar_series(records, groups, lambda r: f"V={r['vocab']}", names, key)

        step_png = grouped_bar_plot(
            reports_dir / "xent_fwd_bwd_ms.png",
            groups,
            series("fwd_bwd_ms"),
            ylabel="fwd+bwd median ms (lower is better)",
            title=f"Cross-entropy fwd+bwd, B={first['batch']}, bf16 ({first['gpu']})",
        )
        gbps_png = grouped_bar_plot(
            reports_dir / "xent_fwd_gbps.png",
            groups,
            series("fwd_gbps"),
            ylabel="forward GB/s (cost-model bytes)",
            title=f"Cross-entropy forward bandwidth ({first['gpu']})",
            reference_line=(first["copy_gbps_measured"], f"measured copy {first['copy_gbps_measured']:.0f} GB/s"),
        )
        geomean = speedups(records)
        summary = [{"implementation": n, "geomean": geomean.get(n)} for n in names]
        return "\n\n".join(
            [
                f"{device_line(first)} · B={first['batch']}, bf16 logits, reduction='none', upstream gradient of "
                f"ones · measured copy bandwidth {first['copy_gbps_measured']:.3g} GB/s",
                *([cpu_note(first["batch"])] if first["gpu"] == "cpu" else []),
                markdown_table(table_rows(records), TABLE_COLUMNS),
                "Geometric-mean fwd+bwd speed-up over PyTorch eager across the vocabularies:",
                markdown_table(summary, [("implementation", "implementation"), ("geomean", "speed-up")]),
                f"![fwd+bwd time]({step_png.name})",
                f"![forward bandwidth]({gbps_png.name})",
            ]
        )
