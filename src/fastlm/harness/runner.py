"""The benchmark runner: every `fastlm bench ...` command and `fastlm report` run a benchmark
through `run_benchmark`.

    preflight (a run that cannot go stops here) -> note (what a CPU run does not measure) -> ceilings
    -> measurements, each appended to <out>/results/<name>.jsonl as it is finished, with the progress
    line -> <out>/reports/<name>.md
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from fastlm.harness.benchmark import Benchmark, Run
from fastlm.utils.progress import print_line, progress_steps
from fastlm.utils.records import append_records


def run_benchmark(benchmark: Benchmark, out: Path, device: torch.device) -> Path:
    """Measure ``benchmark`` on ``device`` and write its report; returns the report's path."""
    results_dir, reports_dir = out / "results", out / "reports"
    benchmark.preflight(device)
    note = benchmark.note(device)
    if note is not None:
        print_line(note)
    run = Run(device, benchmark.ceilings(results_dir, device))
    total = benchmark.count(device)
    progress = (
        progress_steps(benchmark.progress_name, total)
        if benchmark.progress_name is not None and total
        else contextlib.nullcontext(lambda done="": None)
    )
    with progress as step:
        for measured in benchmark.measurements(run):
            append_records(results_dir / benchmark.results_file, measured.records)
            step(measured.label)
    return write_report(
        reports_dir / f"{benchmark.name}.md", benchmark.title, benchmark.render(results_dir, reports_dir)
    )


def write_report(path: Path, title: str, body: str) -> Path:
    """A markdown report: ``# title``, then ``body``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{body}\n")
    return path
