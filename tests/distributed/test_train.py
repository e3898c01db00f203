"""`python -m fastlm.train`: every --parallel mode trains like one process; checkpoints resume exactly;
a checkpoint is neither replaced nor continued by mistake; bad input ends in a one-line error."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from fastlm import checkpoint, train
from fastlm.distributed.launch import exit_process, free_port

from .train_processes import TrainRun

COMMON = ["--preset", "tiny", "--vocab", "50", "--context", "16", "--lr", "1e-2"]


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    exit_process(train.main(argv))  # as `python -m fastlm.train` ends


def _torchrun_like(argv: list[str], world: int = 2) -> None:
    mp.spawn(_rank_main, args=(world, free_port(), argv), nprocs=world)


def _weights(path) -> dict:
    return checkpoint.load(path).state["model"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "model.pt"
    train.main([*COMMON, "--batch", "4", "--steps", "3", "--checkpoint", str(path)])
    return _weights(path)


MODES = [
    ["naive"], ["flat"], ["ddp"], ["bucketed", "--bucket-mb", "0.01"], ["torch-ddp"],
    ["ddp", "--shard-optimizer"], ["fsdp"],
]  # fmt: skip


# Adam divides by sqrt(v): the last-bit differences between one full-batch mean and the average of
# two half-batch means reach ~1e-5 in the weights after 3 steps at lr 1e-2
@pytest.mark.parametrize("mode", MODES, ids=" ".join)
def test_parallel_training_matches_one_process(mode, single_process, tmp_path):
    path = tmp_path / "model.pt"
    _torchrun_like([*COMMON, "--batch", "2", "--steps", "3", "--parallel", *mode, "--checkpoint", str(path)])
    for name, value in _weights(path).items():
        torch.testing.assert_close(value, single_process[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", [["ddp"], ["ddp", "--shard-optimizer"], ["fsdp"]], ids=" ".join)
def test_resume_continues_exactly(mode, single_process, tmp_path):
    path = tmp_path / "model.pt"
    argv = [*COMMON, "--batch", "2", "--parallel", *mode, "--checkpoint", str(path)]
    _torchrun_like([*argv, "--steps", "2"])
    assert checkpoint.newest(path)["step"] == 2
    assert not list(path.glob("*.tmp"))
    _torchrun_like([*argv, "--steps", "3", "--resume"])
    for name, value in _weights(path).items():
        torch.testing.assert_close(value, single_process[name], rtol=1e-4, atol=1e-5, msg=name)


BAD_ARGUMENTS = [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "-5"], "--steps must be at least 1"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--vocab", "0"], "--vocab must be at least 1"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--bucket-mb", "inf"], "--bucket-mb must be a positive number"),
    (["--timeout-s", "-1"], "--timeout-s must be a positive number"),
    (["--seed", "-1"], "--seed must be between 0 and"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--overwrite"], "--overwrite needs --checkpoint"),
    (["--override", "lr"], "--override needs --resume"),
    (["--override", "vocab_size", "--resume"], "invalid choice"),
    (["--checkpoint", "run", "--resume", "--overwrite"], "exclude each other"),
    (["--checkpoint", "run", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    (["--parallel", "fsdp", "--shard-optimizer"], "does not combine"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as raised:
        train.parse_args(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_parallel_mode_needs_torchrun():
    with pytest.raises(SystemExit, match="needs torchrun"):
        train.train(train.parse_args(["--parallel", "ddp"]))


@pytest.fixture
def two_steps(tmp_path):
    """A folder holding the checkpoint of a 2-step single-process run, and its arguments."""
    path = tmp_path / "run"
    argv = [*COMMON, "--batch", "2", "--checkpoint", str(path)]
    assert train.main([*argv, "--steps", "2"]) == 0
    return path, argv


def test_an_existing_checkpoint_is_replaced_only_with_overwrite(two_steps, capsys):
    path, argv = two_steps
    committed = checkpoint.newest(path)
    with pytest.raises(SystemExit):
        train.parse_args([*argv, "--steps", "1"])
    assert "holds a checkpoint (step 2): pass --resume to continue its run or --overwrite" in capsys.readouterr().err
    assert checkpoint.newest(path) == committed
    assert train.main([*argv, "--steps", "1", "--overwrite"]) == 0
    assert checkpoint.newest(path)["step"] == 1
    assert not (path / committed["file"]).exists()


def test_resume_refuses_another_configuration_unless_overridden(two_steps, capsys):
    path, argv = two_steps
    assert train.main([*argv, "--steps", "3", "--resume", "--lr", "0.1", "--batch", "3"]) == 1
    error = capsys.readouterr().err
    assert "batch 2 -> 3, lr 0.01 -> 0.1); pass --override batch --override lr" in error
    assert len(error.splitlines()) == 1
    assert train.main([*argv, "--steps", "3", "--resume", "--vocab", "60"]) == 1
    assert "vocab_size cannot change when resuming" in capsys.readouterr().err
    assert checkpoint.newest(path)["step"] == 2
    # a deliberate change: the new learning rate is the one the optimizer uses from then on
    assert train.main([*argv, "--steps", "3", "--resume", "--lr", "0.1", "--override", "lr"]) == 0
    resumed = checkpoint.load(path)
    assert resumed.step == 3 and resumed.config["lr"] == 0.1
    assert [group["lr"] for group in resumed.state["optimizer"]["param_groups"]] == [0.1]


def test_resume_at_or_past_the_last_step(two_steps, capsys):
    path, argv = two_steps
    committed = checkpoint.newest(path)
    assert train.main([*argv, "--steps", "2", "--resume"]) == 0
    assert "at step 2 of 2: nothing to train" in capsys.readouterr().out
    assert train.main([*argv, "--steps", "1", "--resume"]) == 1
    assert "is at step 2, past --steps 1" in capsys.readouterr().err
    assert checkpoint.newest(path) == committed


def test_a_corrupt_checkpoint_stops_every_rank_with_one_line(tmp_path):
    path = tmp_path / "run"
    argv = [*COMMON, "--batch", "2", "--steps", "3", "--parallel", "ddp", "--checkpoint", str(path)]
    written = checkpoint.save(path, 2, train.run_config(train.parse_args(argv), world=2), {"model": {}})
    written.write_bytes(written.read_bytes()[:-1])
    run = TrainRun([*argv, "--resume"], tmp_path / "logs", "corrupt", world=2)
    assert run.wait() == [1, 1]
    size = written.stat().st_size
    for rank in range(2):
        assert run.output(rank).splitlines() == [
            f"python -m fastlm.train: error: {written} is truncated: {size} of {size + 1} bytes"
        ]
