"""Killing `python -m fastlm.train` at random moments, also in the middle of a checkpoint write, never
tears or loses a committed checkpoint, and resuming until the run is done ends with the parameters
and optimizer state of an uninterrupted run, bit for bit (CPU).

Each series trains the tiny model for STEPS steps with a checkpoint after every step, as one process
and as 2 gloo ranks. A kill (SIGKILL to every rank) comes at a random moment of the training the
run has left: after a random one of its remaining steps is reported, a random time within the
length of a step and its save. The first kill and every second one after it then also wait for a
save in flight (a file of the save that the manifest does not name yet), so that they land inside
a checkpoint write; FASTLM_CHECKPOINT_PAUSE_S stretches the stages of each save so that the other
kills often land inside one too. After a kill:
- torn: the newest checkpoint does not load, or a file the manifest names fails its size or sha256;
- lost: the newest committed step is below one a killed run reported as saved or one seen before.
The run is then resumed (started again when nothing was committed yet), killed again while kills
remain, until it finishes; then a new run starts.

By default the test kills once in each series. FASTLM_FAULT_KILLS=N kills N times, half in each
series; FASTLM_FAULT_RECORD=PATH appends the outcome as a JSON record to PATH.
"""

import hashlib
import json
import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from fastlm import checkpoint
from fastlm.utils.records import append_records, with_environment

from .train_processes import TrainRun

STEPS = 12
ARGV = [
    "--preset",
    "tiny",
    "--context",
    "16",
    "--micro-batch",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "3",
    "--steps",
    str(STEPS),
    "--checkpoint-every",
    "1",
    "--log-every",
    "1",
    "--eval-sequences",
    "4",
    "--eval-every",
    "0",
]
PAUSE_S = 0.02  # per stage of a save (3 stages): kills at random moments often land inside one
SERIES = {"single process": (1, []), "2-rank gloo": (2, ["--parallel", "ddp"])}
DEFAULT_KILLS = len(SERIES)
SAVED = re.compile(r"^checkpoint step (\d+):", re.MULTILINE)


def _identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_identical, a, b))
    return a == b


def _training_state(saved: checkpoint.Checkpoint) -> dict:
    """What a run computed: the state but the run's id (each run of the series has its own)."""
    return {k: v for k, v in saved.state.items() if k != "run_id"}


def _start(directory: Path, data: Path, world: int, mode: list[str], name: str) -> TrainRun:
    """Start (or resume) the run whose checkpoints go to ``directory`` (its --out's checkpoints/); a
    run killed before its first checkpoint left only its log, which a new start replaces."""
    resume = ["--resume"] if checkpoint.newest(directory) is not None else ["--overwrite"]
    argv = ["--data", str(data), *ARGV, *mode, "--out", str(directory.parent), *resume]
    pause = {"FASTLM_CHECKPOINT_PAUSE_S": str(PAUSE_S)}
    return TrainRun(argv, directory.parent.parent / "logs", name, world, env=pause)


def _wait_for_step(run: TrainRun, step: int) -> None:
    """Until rank 0 reports step ``step`` (or the run ends)."""
    while run.running() and f"step {step}/" not in run.output(0):
        time.sleep(0.002)


def _leftovers(directory: Path, since: float) -> set[str]:
    """The files of an unfinished save written since ``since`` (a time.time()): temporaries, and
    checkpoint files that the manifest does not name. Called while a save may be running too."""
    committed = {e["file"] for e in _entries(directory)}
    names = set()
    for path in directory.glob("*"):
        if path.suffix == ".tmp" or (path.name.startswith("step-") and path.name not in committed):
            try:
                if path.stat().st_mtime >= since:
                    names.add(path.name)
            except FileNotFoundError:  # renamed or removed by the running save meanwhile
                pass
    return names


def _entries(directory: Path) -> list[dict]:
    manifest = directory / checkpoint.MANIFEST
    return json.loads(manifest.read_text())["checkpoints"] if manifest.exists() else []


def _kill_at_random(
    run: TrainRun, directory: Path, rng: random.Random, committed: int, step_s: float, in_write: bool
) -> bool:
    """Kill the run at a random moment of the training it has left: a random time within one step
    (and its save) after a random step is reported; with ``in_write``, at the first save in flight
    after that moment. False when the run finished first."""
    started = time.time()
    _wait_for_step(run, rng.randint(min(committed + 1, STEPS), STEPS))  # all committed: the run has nothing left
    time.sleep(rng.uniform(0, step_s))
    while in_write and run.running() and not _leftovers(directory, started):
        time.sleep(0.001)
    run.kill()
    return -signal.SIGKILL in [p.returncode for p in run.processes]


def _check_committed(directory: Path, at_least: int) -> int:
    """Assert that no checkpoint is torn and none lost; returns the newest committed step."""
    for entry in _entries(directory):
        path = directory / entry["file"]
        data = path.read_bytes() if path.exists() else b""
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], f"torn: {entry}"
    step = checkpoint.load(directory).step if _entries(directory) else 0
    assert step >= at_least, f"lost: step {step} committed, {at_least} was saved before"
    return step


def _series(tmp_path: Path, data: Path, world: int, mode: list[str], kills: int, rng: random.Random) -> Counter:
    """Kill runs of one series ``kills`` times; returns counts of kills, kills inside a checkpoint
    write, resumed starts and finished runs (all bit-identical to the reference, or the test fails)."""
    reference = _start(tmp_path / "reference" / "checkpoints", data, world, mode, "reference")
    _wait_for_step(reference, 1)
    start = time.perf_counter()
    assert reference.wait() == [0] * world, reference.output()
    step_s = (time.perf_counter() - start) / (STEPS - 1)  # a step and its save, from the second step on
    expected = _training_state(checkpoint.load(tmp_path / "reference" / "checkpoints"))
    outcome = Counter()
    while outcome["kills"] < kills:
        directory = tmp_path / f"run{outcome['runs']}" / "checkpoints"
        committed, attempt = 0, 0
        while True:
            started = time.time()
            outcome["resumes"] += checkpoint.newest(directory) is not None
            run = _start(directory, data, world, mode, f"run{outcome['runs']}-{attempt}")
            attempt += 1
            in_write = outcome["kills"] % 2 == 0
            killing = outcome["kills"] < kills
            if not (killing and _kill_at_random(run, directory, rng, committed, step_s, in_write)):
                assert run.wait() == [0] * world, run.output()
                break
            outcome["kills"] += 1
            outcome["kills_in_checkpoint_write"] += bool(_leftovers(directory, started))
            saved = [int(step) for step in SAVED.findall(run.output(0))]
            committed = _check_committed(directory, max([committed, *saved]))
        final = checkpoint.load(directory)
        assert final.step == STEPS
        assert _identical(_training_state(final), expected), f"{directory}: the state differs from the reference"
        outcome["runs"] += 1
    return outcome


@pytest.mark.slow
def test_killed_runs_lose_nothing_and_resume_exactly(tmp_path, corpus_data):
    kills = int(os.environ.get("FASTLM_FAULT_KILLS", DEFAULT_KILLS))
    rng = random.Random(0)
    start = time.perf_counter()
    outcomes = {}
    for index, (name, (world, mode)) in enumerate(SERIES.items()):
        share = kills // len(SERIES) + (index < kills % len(SERIES))
        outcomes[name] = _series(tmp_path / name.replace(" ", "-"), corpus_data, world, mode, share, rng)
        if share:  # the first kill and every second one after it wait for a save in flight
            assert outcomes[name]["kills_in_checkpoint_write"] >= 1, outcomes[name]
    wall_s = time.perf_counter() - start
    if os.environ.get("FASTLM_FAULT_RECORD"):
        total = sum(outcomes.values(), Counter())
        record = {
            "op": "fault_injection",
            "status": "ok",
            **total,
            "torn": 0,
            "lost": 0,
            "runs_bit_identical": total["runs"],
            "series": {name: dict(o) for name, o in outcomes.items()},
            "argv": ARGV,
            "checkpoint_pause_s": PAUSE_S,
            "wall_s": round(wall_s, 1),
        }
        append_records(Path(os.environ["FASTLM_FAULT_RECORD"]), [with_environment(record)])
