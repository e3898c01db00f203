"""What a benchmark declares for the runner (`fastlm.harness.runner`).

A benchmark names its cases and, for each case, the implementations measured side by side
(PyTorch eager, torch.compile, fastlm, the best public alternative that is installed); measures
one (case, implementation) into a record; and renders its records into a report section with its
plots. An implementation that cannot run here (no GPU, an optional package missing) and one that
fails (out of memory, a shape it rejects) still get their row, with the reason as its status.

By default every (case, implementation) is measured once, in order, one progress step each. A
benchmark whose protocol pairs measurements otherwise (implementations interleaved round by round,
rounds interleaved across every configuration, worker processes per world size) overrides
`measurements` and `count`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastlm.harness.ceilings import record_ceilings
from fastlm.utils.errors import is_out_of_memory
from fastlm.utils.records import latest_run, read_records, with_environment


@dataclass(frozen=True)
class Implementation:
    """One way of computing what a benchmark measures."""

    name: str
    make: Callable[[Any], Any]  # (case) -> what `Benchmark.measure` times, or a sentence why it is unavailable
    description: str = ""
    needs_gpu: bool = False


@dataclass(frozen=True)
class Run:
    """What a measurement sees of the run it belongs to."""

    device: torch.device
    ceilings: dict | None  # `fastlm.harness.ceilings` record of this run, for benchmarks that divide by it


@dataclass(frozen=True)
class Measured:
    """One progress step: what the progress line says, and the finished records to append."""

    label: str
    records: list[dict]


class Benchmark:
    """Base of every benchmark; a subclass sets the class attributes and the methods below."""

    name: str  # results/<name>.jsonl and reports/<name>.md
    title: str  # the report's heading
    progress_name: str | None = None  # None: the benchmark prints its own progress lines
    cpu_note: str | None = None  # what a run without a GPU does not measure, said before it starts
    measures_ceilings = False  # whether `measure` compares with the device's ceilings, measured first

    @property
    def results_file(self) -> str:
        return f"{self.name}.jsonl"

    def latest_records(self, results_dir: Path) -> list[dict]:
        """The records of this benchmark's latest run under ``results_dir``: a table never mixes runs."""
        return latest_run(read_records(results_dir / self.results_file))

    def preflight(self, device: torch.device) -> None:
        """Raise (`UserError`) for a run that cannot go on ``device``, before anything is printed."""

    def note(self, device: torch.device) -> str | None:
        """Said before the run starts."""
        return self.cpu_note if device.type != "cuda" else None

    def ceilings(self, results_dir: Path, device: torch.device) -> dict | None:
        """The device ceilings this run's records are compared with (None: not used): measured now, so
        that the ratios stay within one run."""
        return record_ceilings(results_dir, device, complete=False) if self.measures_ceilings else None

    def cases(self, device: torch.device) -> Sequence:
        raise NotImplementedError

    def implementations(self, case) -> Sequence[Implementation]:
        raise NotImplementedError

    def describe(self, case, implementation: Implementation, run: Run) -> dict:
        """The record's fields that say what was measured (op, shape, dtype, implementation, ...)."""
        raise NotImplementedError

    def label(self, case, implementation: Implementation) -> str:
        """What the progress line says once (case, implementation) is measured."""
        raise NotImplementedError

    def measure(self, case, made, run: Run) -> dict:
        """{"status": "ok", ...numbers} of ``made`` (what the implementation made) on ``case``; out of
        memory and other RuntimeErrors propagate and become the row's status."""
        raise NotImplementedError

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """The report's markdown body from the records under ``results_dir``; writes the plots."""
        raise NotImplementedError

    def count(self, device: torch.device) -> int:
        """Progress steps of a run: the length of `measurements`."""
        return sum(len(self.implementations(case)) for case in self.cases(device))

    def measurements(self, run: Run) -> Iterator[Measured]:
        """Every (case, implementation) in turn, one record each."""
        for case in self.cases(run.device):
            for implementation in self.implementations(case):
                record = {
                    **self.describe(case, implementation, run),
                    **measure_or_status(self, case, implementation, run),
                }
                yield Measured(self.label(case, implementation), [with_environment(record)])


def failure_status(error: BaseException) -> str:
    """A failed measurement's status: "OOM", or "error: " and the first line of the message."""
    if is_out_of_memory(error):
        return "OOM"
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"error: {first_line[:120]}"


def measure_or_status(benchmark: Benchmark, case, implementation: Implementation, run: Run) -> dict:
    """The implementation's measurement on ``case``, or {"status": why there is none}."""
    if implementation.needs_gpu and run.device.type != "cuda":
        return {"status": "needs a GPU"}
    made = implementation.make(case)
    if isinstance(made, str):
        return {"status": made}
    try:
        return benchmark.measure(case, made, run)
    except RuntimeError as error:  # out of memory, or an implementation that rejects the case
        return {"status": failure_status(error)}
    finally:
        if run.device.type == "cuda":  # here, where the case's tensors (and a traceback holding them) are gone
            torch.cuda.empty_cache()
