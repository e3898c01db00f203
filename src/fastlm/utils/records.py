"""Benchmark records: one JSON object per measurement, appended to ``results/<name>.jsonl``.

Every record carries the environment (GPU, versions, git sha, date) so numbers quoted anywhere
can be traced to the run that produced them.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import subprocess
from collections.abc import Collection, Iterable
from pathlib import Path

import torch

from fastlm.devices import current_device_name


@functools.cache
def environment() -> dict:
    """Where and with what a record was measured."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "run_id": f"{now:%Y%m%dT%H%M%S}-{os.getpid()}",  # one per process: never mix runs in a table
        "gpu": current_device_name(),
        "torch": torch.__version__,
        "triton": triton_version,
        "git_sha": _git_sha(),
        "date": now.isoformat(timespec="seconds"),
    }


CODE_PATHS = (":/src", ":/pyproject.toml", ":/benchmarks/*.py", ":/benchmarks/*.sh")  # what a record measures


def _git_sha() -> str | None:
    """HEAD's short sha, with a "+" when the package's code or the benchmark scripts differ from it
    (the record then measured code that no commit holds; the records and reports that scripts
    append to do not count); FASTLM_GIT_SHA instead, where the tree was copied without its .git
    folder: whoever sets it vouches for the tree."""
    if os.environ.get("FASTLM_GIT_SHA"):
        return os.environ["FASTLM_GIT_SHA"]
    try:
        sha = _git("rev-parse", "--short", "HEAD")
        changes = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+" if changes else "")


def _git(*args: str) -> str:
    """The output of a git command run in this package's folder."""
    out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    return out.stdout.strip()


def with_environment(record: dict) -> dict:
    return {**record, **environment()}


def append_records(path: Path, records: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def read_records(path: Path) -> list[dict]:
    """The records in ``path`` of runs that finished: a record with ``"complete": false`` (its run was
    interrupted or failed, see `mark_complete`) is left out, so a partial run never replaces a
    complete one in a table; a record without the field counts as complete."""
    if not path.exists():
        return []
    with path.open() as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("complete", True)]


def mark_complete(path: Path, run_ids: Collection[str]) -> None:
    """Set ``"complete": true`` on the records of the runs ``run_ids`` in ``path``, which a benchmark
    appended with false as each was measured, once the run has finished; every other line stays as
    it is. The new file replaces the old one whole (rename), so an interruption leaves either."""
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if '"complete": false' in line:
            record = json.loads(line)
            if record.get("run_id") in run_ids:
                lines[i] = json.dumps({**record, "complete": True}, sort_keys=True) + "\n"
    staged = path.with_name(path.name + ".partial")
    staged.write_text("".join(lines))
    staged.replace(path)


def latest_run(records: list[dict]) -> list[dict]:
    """The records of the run that wrote the last one, so a table never mixes timings of runs."""
    if not records:
        return []
    run_id = records[-1]["run_id"]
    return [r for r in records if r["run_id"] == run_id]


def latest_runs_by(records: list[dict], key: str) -> list[list[dict]]:
    """For each value of ``key`` (e.g. the number of ranks), its records from the latest run that
    has it; grouped by run, oldest run first. A report can then show a 2-and-4-GPU run next to a
    later 8-GPU run while no table mixes the timings of two runs."""
    latest: dict = {}
    for r in records:
        latest[r[key]] = r["run_id"]
    runs: dict[str, list[dict]] = {}
    for r in records:
        if latest[r[key]] == r["run_id"]:
            runs.setdefault(r["run_id"], []).append(r)
    return list(runs.values())
