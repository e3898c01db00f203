"""What the memory-bound kernel benchmarks share (`fastlm bench norms | softmax | conv1d`).

Protocol (one run, one device, all baselines side by side): the op's inputs are drawn once, those
that training differentiates with requires_grad, and an upstream gradient dy of the output's shape.
fwd is the call as in training (autograd records the graph), bwd is `y.backward(dy)` after an
untimed forward (CUDA events around the backward only), fwd+bwd both. On a GPU, fwd and fwd+bwd
are also timed as CUDA-graph replays: the same kernels without the host's dispatch, so a small op
whose Python and launch cost exceeds its GPU time shows both what eager code pays and what its
kernels do (and a slow host on one machine does not read as a slow kernel). GB/s divide each
op's *minimum* bytes (every tensor read or written once) by the time, for every implementation
alike, so they compare as effective bandwidths against the copy bandwidth measured in the same run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastlm.harness.benchmark import Benchmark, Implementation, Run, failure_status
from fastlm.harness.timing import (
    Timing,
    drop_grads,
    measure,
    measure_after_setup,
    measure_graph_replay,
    noted_status,
    stage_times,
)
from fastlm.utils.plots import grouped_bar_plot
from fastlm.utils.tables import device_line, markdown_table, present_columns

STAGES = ("fwd", "bwd", "fwd_bwd")
CPU_NOTE = (
    "No GPU: fastlm's kernels run their plain-PyTorch reference paths (the Triton interpreter under "
    "TRITON_INTERPRET=1), not the Triton kernels, at reduced shapes; torch.compile, Liger, the CUDA C++ "
    "conv and the CUDA-graph replays need a GPU and are not measured. These GB/s say nothing about the "
    "kernels' bandwidth on a GPU."
)


def measure_stages(
    fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    dy: torch.Tensor,
    stage_bytes: dict[str, int],
    copy_gbps: float,
    device: torch.device,
) -> dict:
    """Times of fwd, bwd and fwd+bwd of ``fn(*inputs)`` (``{stage}_ms``, ``{stage}_gbps`` from
    ``stage_bytes``, ``{stage}_fraction_of_copy`` of ``copy_gbps``); on CUDA also stages
    ``fwd_graph`` and ``fwd_bwd_graph`` (replayed as CUDA graphs), or ``{stage}_status`` saying why
    one could not be timed. A failure of the eager stages propagates (the runner makes it the status)."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]

    def forward_fresh_graph():
        drop_grads(leaves)
        return fn(*inputs)

    stages = {
        "fwd": measure(lambda: fn(*inputs), device),
        "bwd": measure_after_setup(
            forward_fresh_graph, lambda y: y.backward(dy), device, reps=40 if device.type == "cuda" else 5
        ),
        "fwd_bwd": measure(lambda: fn(*inputs).backward(dy), device, grad_to_none=leaves),
    }
    result: dict = {"status": "ok"}
    for stage, timing in stages.items():
        result.update(_stage_fields(stage, timing, stage_bytes[stage], copy_gbps))
    graphed = {
        "fwd_graph": (lambda: fn(*inputs), "fwd"),
        "fwd_bwd_graph": (lambda: fn(*inputs).backward(dy), "fwd_bwd"),
    }
    for stage, (call, eager_stage) in graphed.items() if device.type == "cuda" else ():
        try:
            timing = measure_graph_replay(call, device, leaves)
            result.update(_stage_fields(stage, timing, stage_bytes[eager_stage], copy_gbps))
        except RuntimeError as error:  # the row's other stages stand; the table says why this one is empty
            result[f"{stage}_status"] = failure_status(error)
    return result


def _stage_fields(stage: str, timing: Timing, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / (timing.median_ms * 1e-3) / 1e9
    return {**stage_times(stage, timing), f"{stage}_gbps": gbps, f"{stage}_fraction_of_copy": gbps / copy_gbps}


BANDWIDTH_COLUMNS = [
    ("implementation", "implementation"),
    ("fwd_ms", "fwd ms"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("fwd_gbps", "fwd GB/s"),
    ("fwd_percent_of_copy", "fwd % of copy"),
    ("fwd_bwd_gbps", "fwd+bwd GB/s"),
    ("fwd_bwd_percent_of_copy", "fwd+bwd % of copy"),
    ("fwd_graph_percent_of_copy", "fwd % of copy, CUDA graph"),
    ("fwd_bwd_graph_ms", "fwd+bwd ms, CUDA graph"),
    ("fwd_bwd_graph_percent_of_copy", "fwd+bwd % of copy, CUDA graph"),
    ("status", "status"),
]


def render_bandwidth(
    records: list[dict],
    case_columns: Sequence[tuple[str, str]],
    case_label: Callable[[dict], str],
    plot_path: Path,
    title: str,
) -> str:
    """Device line, one table row per (case, implementation) and a bar plot of fwd+bwd GB/s per
    case with the measured copy bandwidth drawn across (and, on a GPU, a tick per bar at the GB/s
    of the same fwd+bwd replayed as a CUDA graph)."""
    rows = []
    for r in records:
        row = dict(r)
        for stage in ("fwd", "fwd_bwd", "fwd_graph", "fwd_bwd_graph"):
            if f"{stage}_fraction_of_copy" in r:
                row[f"{stage}_percent_of_copy"] = 100 * r[f"{stage}_fraction_of_copy"]
        failed = [
            f"{stage.replace('_graph', '').replace('_', '+')} CUDA graph {r[f'{stage}_status']}"
            for stage in ("fwd_graph", "fwd_bwd_graph")
            if f"{stage}_status" in r
        ]
        row["status"] = "; ".join([noted_status(r), *failed])
        rows.append(row)
    groups = list(dict.fromkeys(case_label(r) for r in rows))
    implementations = list(dict.fromkeys(r["implementation"] for r in rows))

    def per_case(key):
        return {
            impl: [
                next((r.get(key) for r in rows if case_label(r) == g and r["implementation"] == impl), None)
                for g in groups
            ]
            for impl in implementations
        }

    graphed = per_case("fwd_bwd_graph_gbps")
    has_graphed = any(v is not None for values in graphed.values() for v in values)
    first = records[0]
    plot = grouped_bar_plot(
        plot_path,
        groups,
        per_case("fwd_bwd_gbps"),
        ylabel="fwd+bwd GB/s (minimum bytes)",
        title=f"{title} ({first['gpu']})",
        reference_line=(first["copy_gbps_measured"], "measured copy"),
        markers=(graphed, "replayed as a CUDA graph") if has_graphed else None,
    )
    return "\n\n".join(
        [
            f"{device_line(first)} · measured copy bandwidth {first['copy_gbps_measured']:.3g} GB/s",
            *([CPU_NOTE] if first["gpu"] == "cpu" else []),
            markdown_table(rows, present_columns(rows, [*case_columns, *BANDWIDTH_COLUMNS])),
            f"![fwd+bwd bandwidth]({plot.name})",
        ]
    )


class BandwidthBenchmark(Benchmark):
    """A memory-bound op: cases x implementations, each timed by `measure_stages` against this run's
    copy bandwidth; one table and one fwd+bwd GB/s plot. A subclass names its cases' record fields."""

    cpu_note = CPU_NOTE
    measures_ceilings = True
    case_columns: tuple[tuple[str, str], ...]  # (record key, header) of the fields that name a case
    plot_title: str
    empty_report: str  # the report before any run

    def case_fields(self, case) -> dict:
        """The record fields that name ``case`` (op, shape, dtype, ...)."""
        raise NotImplementedError

    def case_label(self, record: dict) -> str:
        """A case in a progress line and on the plot's axis, from its record."""
        raise NotImplementedError

    def shown(self, record: dict) -> dict:
        """``record`` as the table shows it: with any field the case columns compute."""
        return record

    def describe(self, case, implementation: Implementation, run: Run) -> dict:
        return {
            **self.case_fields(case),
            "implementation": implementation.name,
            "copy_gbps_measured": run.ceilings["copy_gbps"],
        }

    def label(self, case, implementation: Implementation) -> str:
        return f"{self.case_label(self.case_fields(case))} {implementation.name}"

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        records = [self.shown(r) for r in self.latest_records(results_dir)]
        if not records:
            return self.empty_report
        return render_bandwidth(
            records, self.case_columns, self.case_label, reports_dir / f"{self.name}_fwd_bwd_gbps.png", self.plot_title
        )
