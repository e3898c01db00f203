"""The benchmark runner: every `fastlm bench ...` command and `fastlm report` run a benchmark
through `run_benchmark`.

    preflight (a run that cannot go stops here) -> note (what a CPU run does not measure) -> ceilings
    ("complete": false) -> measurements, each appended to <out>/results/<name>.jsonl as it is
    finished ("complete": false), with the progress line -> the run's records and ceilings marked
    complete -> <out>/reports/<name>.md
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from fastlm.harness.benchmark import Benchmark, Run
from fastlm.harness.ceilings import RESULTS_FILE as CEILINGS_FILE
from fastlm.utils.progress import print_line, progress_steps
from fastlm.utils.records import append_records, mark_complete


def run_benchmark(
    benchmark: Benchmark, out: Path, device: torch.device, step: Callable[..., None] | None = None
) -> Path:
    """Measure ``benchmark`` on ``device`` and write its report; returns the report's path.
    ``step``: the progress of a run of several benchmarks (`fastlm report`), which also says once what
    a CPU run does not measure; by default the benchmark's own progress and note."""
    results_dir, reports_dir = out / "results", out / "reports"
    results = results_dir / benchmark.results_file
    benchmark.preflight(device)
    note = benchmark.note(device) if step is None else None
    if note is not None:
        print_line(note)
    run = Run(device, benchmark.ceilings(results_dir, device))
    if run.ceilings is not None and not run.ceilings.get("complete", True):  # measured by this run
        run_ids_by_file = {results_dir / CEILINGS_FILE: {run.ceilings["run_id"]}}
    else:
        run_ids_by_file = {}
    total = benchmark.count(device)
    if step is not None:
        progress = contextlib.nullcontext(lambda done="": step(f"{benchmark.progress_name} {done}".strip()))
    elif benchmark.progress_name is not None and total:
        progress = progress_steps(benchmark.progress_name, total)
    else:
        progress = contextlib.nullcontext(lambda done="": None)
    run_ids: set[str] = set()  # the records' runs: the worker processes of a distributed benchmark have their own
    try:
        with progress as advance:
            for measured in benchmark.measurements(run):
                # partial until the run ends: an interrupted run's records never replace a complete one
                append_records(results, [{**record, "complete": False} for record in measured.records])
                run_ids.update(record["run_id"] for record in measured.records)
                advance(measured.label)
    except BaseException:  # Ctrl-C or an error: say what became of the records, then stop as asked
        if run_ids:
            print_line(f"{benchmark.name}: stopped before the end; its records in {results} are kept as partial")
        raise
    if run_ids:
        run_ids_by_file[results] = run_ids
    for path, ids in run_ids_by_file.items():
        mark_complete(path, ids)
    return write_report(
        reports_dir / f"{benchmark.name}.md", benchmark.title, benchmark.render(results_dir, reports_dir)
    )


def write_report(path: Path, title: str, body: str) -> Path:
    """A markdown report: ``# title``, then ``body``; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{body}\n")
    return path
