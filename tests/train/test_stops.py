"""How a run of `fastlm train` stops. A loss or gradient norm that is not finite stops it with one
line naming the first such step, before anything of that step is logged or saved, so the newest
checkpoint stays the last finite state (bit for bit a run's checkpoint of that step); nor is a
checkpoint of a non-finite state ever written. --skip-non-finite N drops the update of such steps,
counts them in the log and stops after N in a row. SIGTERM ends the run after the step in
progress with a checkpoint of it (status 143), from which --resume continues exactly. Under two
gloo ranks (a process each) every rank takes the same decision at the same step: a nan on one
rank stops both; SIGTERM at different steps saves one step, the same on both."""

import os
import signal

import pytest
import torch
import torch.multiprocessing as mp

from fastlm import checkpoint
from fastlm.distributed.launch import exit_process, free_port
from fastlm.model import TransformerLM
from fastlm.train import loop
from fastlm.train.log import read_log

# a constant learning rate, so that steps agree whatever --steps is; a log record per step
SMALL = [
    "--preset",
    "tiny",
    "--context",
    "16",
    "--micro-batch",
    "2",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
    "--min-lr-ratio",
    "1",
    "--eval-sequences",
    "4",
    "--eval-every",
    "0",
    "--keep-checkpoints",
    "10",
]


def _main(corpus_data, out, *argv) -> int:
    return loop.main(["--data", str(corpus_data), *SMALL, "--out", str(out), *argv])


def _identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_identical, a, b))
    return a == b


def _training_state(out, step: int) -> dict:
    """What a run computed up to ``step``: its checkpoint's state but the run's id."""
    return {k: v for k, v in checkpoint.load(out / "checkpoints", step=step).state.items() if k != "run_id"}


def _all_finite(state) -> bool:
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(state.isfinite().all())
    if isinstance(state, dict):
        return all(map(_all_finite, state.values()))
    if isinstance(state, (list, tuple)):
        return all(map(_all_finite, state))
    return True


def _untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "elapsed_s")} for r in records]


class _Steps:
    """Counts the training steps (the schedule is asked for each step's learning rate, once)."""

    def __init__(self, monkeypatch) -> None:
        self.current = 0
        schedule = loop.warmup_cosine_lr

        def counted(step, **kwargs):
            self.current = step + 1  # the 1-based step about to run
            return schedule(step, **kwargs)

        monkeypatch.setattr(loop, "warmup_cosine_lr", counted)


def _poison_gradients(monkeypatch, steps: _Steps, at: set[int]) -> None:
    """A nan in one gradient at the steps ``at``: their gradient norm is nan, their loss finite."""
    clip = loop._clip_gradients

    def poisoned(model, config):
        if steps.current in at:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        return clip(model, config)

    monkeypatch.setattr(loop, "_clip_gradients", poisoned)


def _poison_losses(monkeypatch, steps: _Steps, at: set[int]) -> None:
    """A nan added to the training loss at the steps ``at``: their loss is nan, their gradients
    (of a constant added) stay finite."""
    forward = TransformerLM.forward

    def poisoned(self, *args, **kwargs):
        loss = forward(self, *args, **kwargs)
        return loss + float("nan") if torch.is_grad_enabled() and steps.current in at else loss

    monkeypatch.setattr(TransformerLM, "forward", poisoned)


@pytest.fixture(scope="module")
def straight(corpus_data, tmp_path_factory):
    """A run of 6 steps without trouble, a checkpoint after each second step."""
    out = tmp_path_factory.mktemp("straight")
    assert _main(corpus_data, out, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1") == 0
    return out


@pytest.mark.parametrize(
    ("poison", "found"),
    [(_poison_gradients, "the gradient norm is nan"), (_poison_losses, "the loss is nan")],
    ids=["gradient", "loss"],
)
def test_a_non_finite_step_stops_the_run_and_keeps_the_last_finite_checkpoint(
    poison, found, corpus_data, straight, tmp_path, monkeypatch, capsys
):
    # step 5 goes wrong; the check runs at the log step 6 (--log-every 3), where a checkpoint is due
    poison(monkeypatch, _Steps(monkeypatch), at={5})
    status = _main(corpus_data, tmp_path, "--steps", "6", "--checkpoint-every", "2", "--log-every", "3")
    assert status == 1
    error = capsys.readouterr().err
    assert error.splitlines() == [
        f"python -m fastlm.train: error: step 5: {found}, so the run stopped; the newest checkpoint, of step 4, "
        "is the last finite state: --resume continues from it, with a lower --lr (and --override lr), a "
        "--grad-clip (and --override grad_clip) or --skip-non-finite"
    ]
    assert checkpoint.steps(tmp_path / "checkpoints") == [2, 4]  # none of step 6
    for step in (2, 4):
        assert _identical(_training_state(tmp_path, step), _training_state(straight, step)), step
    # records at the log and checkpoint steps; none of the interval of step 5
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [0, 2, 3, 4]


def test_a_non_finite_step_without_a_checkpoint_stops_at_the_next_log_step(corpus_data, tmp_path, monkeypatch, capsys):
    steps = _Steps(monkeypatch)
    _poison_gradients(monkeypatch, steps, at={2})
    assert _main(corpus_data, tmp_path, "--steps", "20", "--log-every", "4", "--checkpoint-every", "0") == 1
    assert steps.current == 4  # the step of the next check: not one more
    error = capsys.readouterr().err
    assert error.startswith("python -m fastlm.train: error: step 2: the gradient norm is nan, so the run stopped; ")
    assert error.rstrip().endswith(
        "it saved no checkpoint: --overwrite starts it again, with a lower --lr, a --grad-clip or --skip-non-finite"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_state_that_is_not_finite_is_never_saved(corpus_data, straight, tmp_path, monkeypatch, capsys):
    # the update of step 4 leaves an inf in a weight, though its loss and gradient norm were finite
    build = loop._optimizer

    def optimizer_that_overflows(model, config, device):
        optimizer = build(model, config, device)
        step, calls = optimizer.step, []

        def overflowing_step(*args, **kwargs):
            step(*args, **kwargs)
            calls.append(None)
            if len(calls) == 4:
                with torch.no_grad():
                    model.blocks[0].ffn.w2.weight.view(-1)[3] = float("inf")

        optimizer.step = overflowing_step
        return optimizer

    monkeypatch.setattr(loop, "_optimizer", optimizer_that_overflows)
    assert _main(corpus_data, tmp_path, "--steps", "6", "--checkpoint-every", "2", "--log-every", "1") == 1
    assert (
        "error: after step 4 parameter blocks.0.ffn.w2.weight holds an inf or nan, so its checkpoint was not "
        "saved; the newest checkpoint, of step 2, is the last finite state" in capsys.readouterr().err
    )
    assert checkpoint.steps(tmp_path / "checkpoints") == [2]
    assert _identical(_training_state(tmp_path, 2), _training_state(straight, 2))


def test_skip_non_finite_drops_the_updates_of_such_steps_and_counts_them(corpus_data, tmp_path, monkeypatch, capsys):
    steps = _Steps(monkeypatch)
    _poison_gradients(monkeypatch, steps, at={3})
    _poison_losses(monkeypatch, steps, at={4})  # the loss alone: its gradients are finite, still skipped
    argv = ["--steps", "6", "--checkpoint-every", "2", "--log-every", "2", "--skip-non-finite", "2"]
    assert _main(corpus_data, tmp_path, *argv) == 0
    records = read_log(tmp_path / "log.jsonl")
    assert [(r["step"], r.get("skipped")) for r in records] == [(0, None), (2, 0), (4, 2), (6, 0)]
    assert "loss" not in records[2] and "grad_norm" not in records[2]  # nothing of steps 3 and 4 counts
    assert "step 4/6 | lr 1.00e-02 | 2 skipped | " in capsys.readouterr().out
    after_two, after_four = (checkpoint.load(tmp_path / "checkpoints", step=s).state for s in (2, 4))
    assert _identical(after_four["model"], after_two["model"])  # no update in steps 3 and 4
    assert _identical(after_four["optimizer"], after_two["optimizer"])
    assert after_four["data"]["position"] == 4 * 2  # their batches are consumed all the same
    final = checkpoint.load(tmp_path / "checkpoints").state["optimizer"]["state"]
    assert {s["step"].item() for s in final.values()} == {4.0}  # 6 steps, 2 of them skipped
    assert all(_all_finite(checkpoint.load(tmp_path / "checkpoints", step=s).state) for s in (2, 4, 6))


def test_skip_non_finite_stops_after_too_many_in_a_row(corpus_data, tmp_path, monkeypatch, capsys):
    steps = _Steps(monkeypatch)
    _poison_gradients(monkeypatch, steps, at={2, 4, 5, 6})
    argv = ["--steps", "10", "--log-every", "5", "--checkpoint-every", "0", "--skip-non-finite", "2"]
    assert _main(corpus_data, tmp_path, *argv) == 1
    assert steps.current == 6  # the third in a row: at once, not at a log step
    error = capsys.readouterr().err
    assert error.startswith(
        "python -m fastlm.train: error: steps 4-6: 3 steps in a row had a loss or gradient norm that is not "
        "finite, more than --skip-non-finite 2 allows, so the run stopped; it saved no checkpoint: --overwrite "
        "starts it again, with a lower --lr or a --grad-clip\n"
    )


def test_sigterm_saves_the_step_in_progress_and_resume_continues_exactly(
    corpus_data, straight, tmp_path, monkeypatch, capsys
):
    argv = ["--steps", "6", "--checkpoint-every", "2", "--log-every", "1"]
    schedule = loop.warmup_cosine_lr

    def terminated_in_step_3(step, **kwargs):
        if step == 2:  # step 3 begins: SIGTERM lands in its middle
            os.kill(os.getpid(), signal.SIGTERM)
        return schedule(step, **kwargs)

    calls = []

    def handler(*args):
        calls.append(args)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        monkeypatch.setattr(loop, "warmup_cosine_lr", terminated_in_step_3)
        assert _main(corpus_data, tmp_path, *argv) == 143
        assert signal.getsignal(signal.SIGTERM) is handler and not calls  # the run's handler took it, and is gone
        os.kill(os.getpid(), signal.SIGTERM)
        assert len(calls) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.undo()
    assert capsys.readouterr().err.splitlines() == [
        f"python -m fastlm.train: stopped by SIGTERM after step 3 and saved its checkpoint in "
        f"{tmp_path / 'checkpoints'}: the same command with --resume continues it"
    ]
    assert checkpoint.steps(tmp_path / "checkpoints") == [2, 3]
    assert checkpoint.load(tmp_path / "checkpoints").state["data"] == {"position": 3 * 2}
    assert _main(corpus_data, tmp_path, *argv, "--resume") == 0
    assert _untimed(read_log(tmp_path / "log.jsonl")) == _untimed(read_log(straight / "log.jsonl"))
    for step in (4, 6):
        assert _identical(_training_state(tmp_path, step), _training_state(straight, step)), step


def _rank_with_a_nan_loss(rank: int, world: int, port: int, argv: list[str]) -> None:
    """A rank of a gloo run whose rank 1 alone has a nan loss at step 3 (its gradients stay finite)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    patch = pytest.MonkeyPatch()
    steps = _Steps(patch)
    _poison_losses(patch, steps, at={3} if rank == 1 else set())
    exit_process(loop.main(argv))


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(corpus_data, tmp_path, capfd):
    argv = ["--data", str(corpus_data), *SMALL, "--out", str(tmp_path), "--parallel", "ddp", "--timeout-s", "60"]
    argv += ["--steps", "6", "--checkpoint-every", "2", "--log-every", "2"]
    spawned = mp.spawn(_rank_with_a_nan_loss, args=(2, free_port(), argv), nprocs=2, join=False)
    for process in spawned.processes:
        process.join(120)
    assert [p.exitcode for p in spawned.processes] == [1, 1]  # neither waits for the other
    # each rank's line (the two processes write stderr at once: counted, not split into lines)
    error = capfd.readouterr().err
    assert error.count("python -m fastlm.train: error: step 3: the loss is nan, so the run stopped; ") == 2
    assert checkpoint.steps(tmp_path / "checkpoints") == [2]


def _rank_terminated(rank: int, world: int, port: int, argv: list[str]) -> None:
    """A rank of a gloo run that gets SIGTERM as step 3 (rank 0) or step 5 (rank 1) begins: as torchrun
    forwards it, to every rank, but not at the same step."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    schedule = loop.warmup_cosine_lr

    def terminated(step, **kwargs):
        if step + 1 == (3 if rank == 0 else 5):
            os.kill(os.getpid(), signal.SIGTERM)
        return schedule(step, **kwargs)

    loop.warmup_cosine_lr = terminated
    exit_process(loop.main(argv))


def test_sigterm_at_different_steps_of_two_ranks_saves_one_step_on_both(corpus_data, tmp_path, capfd):
    # the ranks learn of rank 0's SIGTERM of step 3 from an all-reduce that runs during step 4, and stop after it
    argv = ["--data", str(corpus_data), *SMALL, "--out", str(tmp_path), "--parallel", "ddp", "--timeout-s", "60"]
    argv += ["--steps", "8", "--log-every", "3"]
    spawned = mp.spawn(_rank_terminated, args=(2, free_port(), argv), nprocs=2, join=False)
    for process in spawned.processes:
        process.join(120)
    assert [p.exitcode for p in spawned.processes] == [143, 143]
    lines = [line for line in capfd.readouterr().err.splitlines() if "stopped by SIGTERM" in line]
    assert lines == [  # rank 0's
        f"python -m fastlm.train: stopped by SIGTERM after step 4 and saved its checkpoint in "
        f"{tmp_path / 'checkpoints'}: the same command with --resume continues it"
    ]
    saved = checkpoint.load(tmp_path / "checkpoints")
    assert saved.step == 4 and saved.state["data"]["position"] == 4 * 4  # 2 ranks x 2 windows a step
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [0, 3, 4]  # 4: the interval up to the stop
