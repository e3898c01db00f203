"""`python -m fastlm.train`: every --parallel mode trains like one process (the same losses and
weights for the same global batch); checkpoints resume exactly; a checkpoint is neither replaced
nor continued by mistake; bad input ends in a one-line error."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from fastlm import checkpoint
from fastlm.data.tokens import TokenData
from fastlm.distributed.launch import exit_process, free_port
from fastlm.distributed.wrappers import DEFAULT_BUCKET_MB
from fastlm.train import loop
from fastlm.train.config import TrainConfig
from fastlm.train.log import read_log
from fastlm.utils.errors import UserError

from .train_processes import TrainRun

# a constant learning rate (no warmup, no decay), so that runs of 2 and 3 steps agree on their first 2
SETTINGS = [
    "--preset",
    "tiny",
    "--context",
    "16",
    "--micro-batch",
    "2",
    "--batch-tokens",
    "64",
    "--lr",
    "1e-2",
    "--warmup",
    "0",
    "--min-lr-ratio",
    "1",
    "--log-every",
    "1",
    "--eval-sequences",
    "4",
]


@pytest.fixture(scope="module")
def common(corpus_data) -> list[str]:
    return ["--data", str(corpus_data), *SETTINGS]


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    exit_process(loop.main(argv))  # as `python -m fastlm.train` ends


def _torchrun_like(argv: list[str], world: int = 2) -> None:
    mp.spawn(_rank_main, args=(world, free_port(), argv), nprocs=world)


def _weights(out) -> dict:
    return checkpoint.load(out / "checkpoints").state["model"]


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_log(out / "log.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def single_process(common, tmp_path_factory):
    """One process, 2 micro-batches of 2 windows per step: its weights and losses after 3 steps."""
    out = tmp_path_factory.mktemp("single")
    assert loop.main([*common, "--steps", "3", "--out", str(out)]) == 0
    return _weights(out), _losses(out)


MODES = [
    ["naive"],
    ["flat"],
    ["ddp"],
    ["bucketed", "--bucket-mb", "0.01"],
    ["torch-ddp"],
    ["ddp", "--shard-optimizer"],
    ["fsdp"],
]


# Adam divides by sqrt(v): the last-bit differences between one full-batch mean and the average of
# two half-batch means reach ~1e-5 in the weights after 3 steps at lr 1e-2
@pytest.mark.parametrize("mode", MODES, ids=" ".join)
def test_parallel_training_matches_one_process(mode, common, single_process, tmp_path):
    _torchrun_like([*common, "--steps", "3", "--parallel", *mode, "--out", str(tmp_path)])
    weights, losses = single_process
    for name, value in _weights(tmp_path).items():
        torch.testing.assert_close(value, weights[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(_losses(tmp_path), losses, rtol=1e-5, atol=0)
    # run.json: the bucket size in use, given or the mode's default
    expected = float(mode[2]) if "--bucket-mb" in mode else DEFAULT_BUCKET_MB.get(mode[0])
    assert json.loads((tmp_path / "run.json").read_text())["bucket_mb"] == expected


@pytest.mark.slow
def test_bucketed_clips_a_bf16_wire_as_flat_clips_after(common, tmp_path):
    """bucketed clips while it casts its bf16 buckets back to fp32 (`Wrapped.synchronize_and_clip`);
    flat averages the same bf16 values and the loop clips after: the same steps, bitwise."""
    runs = []
    for mode in (["flat"], ["bucketed", "--bucket-mb", "0.01"], ["bucketed"]):  # a bucket per tensor; one
        out = tmp_path / "-".join(mode)
        _torchrun_like([*common, "--steps", "3", "--reduce-dtype", "bf16", "--parallel", *mode, "--out", str(out)])
        norms = [r["grad_norm"] for r in read_log(out / "log.jsonl") if "grad_norm" in r]
        runs.append((mode, _weights(out), _losses(out), norms))
    _, weights, losses, norms = runs[0]
    assert max(norms) > 1.0, "the gradients were never clipped"  # --grad-clip's default is 1
    for mode, other_weights, other_losses, other_norms in runs[1:]:
        assert other_norms == norms and other_losses == losses, mode
        for name, value in other_weights.items():
            assert torch.equal(value, weights[name]), f"{mode}: {name}"


@pytest.mark.parametrize(
    "mode",
    [
        ["fsdp"],
        pytest.param(["fsdp", "--recompute"], marks=pytest.mark.slow),
        pytest.param(["fsdp", "--bucket-mb", "0.001"], marks=pytest.mark.slow),
        pytest.param(["ddp"], marks=pytest.mark.slow),
    ],
    ids=" ".join,
)
def test_compiled_training_matches_one_process(mode, common, tmp_path):
    """Compiled (fsdp: the blocks' stack as one graph where it is one unit, as the tiny model is in
    the default units, else each block on its own; ddp: the wrapped model), the same training as
    one eager process, up to the compiled kernels' summation order. With one block: both ranks
    compile at once (Inductor's C++ for a CPU), and a second block adds a quarter to the time."""
    argv = [*common, "--layers", "1", "--steps", "3"]
    assert loop.main([*argv, "--out", str(tmp_path / "single")]) == 0
    _torchrun_like([*argv, "--parallel", *mode, "--compile", "compile", "--out", str(tmp_path / "parallel")])
    weights, losses = _weights(tmp_path / "single"), _losses(tmp_path / "single")
    for name, value in _weights(tmp_path / "parallel").items():
        torch.testing.assert_close(value, weights[name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(_losses(tmp_path / "parallel"), losses, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["ddp"], marks=pytest.mark.slow),
        ["bucketed", "--bucket-mb", "0.01"],
        pytest.param(["torch-ddp"], marks=pytest.mark.slow),
    ],
    ids=" ".join,
)
def test_bf16_weights_train_in_parallel_like_one_process(mode, common, tmp_path):
    # two ranks add their bf16 gradient halves as one process adds its two micro-batches': the same
    # sums, so the same weights and losses
    argv = [*common, "--steps", "3", "--precision", "bf16-weights"]
    assert loop.main([*argv, "--out", str(tmp_path / "single")]) == 0
    _torchrun_like([*argv, "--parallel", *mode, "--out", str(tmp_path / "parallel")])
    weights = _weights(tmp_path / "single")
    for name, value in _weights(tmp_path / "parallel").items():
        assert value.dtype == weights[name].dtype and torch.equal(value, weights[name]), name
    assert _losses(tmp_path / "parallel") == _losses(tmp_path / "single")


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["ddp"], marks=pytest.mark.slow),
        pytest.param(["ddp", "--shard-optimizer"], marks=pytest.mark.slow),
        ["fsdp"],
    ],
    ids=" ".join,
)
def test_resume_continues_exactly(mode, common, single_process, tmp_path):
    argv = [*common, "--parallel", *mode, "--out", str(tmp_path)]
    _torchrun_like([*argv, "--steps", "2"])
    assert checkpoint.newest(tmp_path / "checkpoints")["step"] == 2
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    _torchrun_like([*argv, "--steps", "3", "--resume", "--override", "steps"])
    resumed = checkpoint.load(tmp_path / "checkpoints")
    assert resumed.state["data"]["position"] == 3 * 4  # windows consumed: 4 a step
    for name, value in resumed.state["model"].items():
        torch.testing.assert_close(value, single_process[0][name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(_losses(tmp_path), single_process[1], rtol=1e-5, atol=0)


BAD_ARGUMENTS = [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "-5"], "--steps must be at least 1"),
    (["--micro-batch", "0"], "--micro-batch must be at least 1"),
    (["--context", "0"], "--context must be at least 1"),
    (["--warmup", "-1"], "--warmup must be 0 or more"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--grad-clip", "-1"], "--grad-clip must be 0 or a positive number"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be between 0 and 1"),
    (["--bucket-mb", "inf"], "--bucket-mb must be a positive number"),
    (["--timeout-s", "-1"], "--timeout-s must be a positive number"),
    (["--seed", "-1"], "--seed must be between 0 and"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0 or more"),
    (["--heads", "3"], "--d-model (64) must be divisible by --heads (3)"),
    (
        ["--batch-tokens", "100"],
        "--batch-tokens must be a positive multiple of --context x --micro-batch x "
        "processes = 512 x 8 x 1 = 4096, got 100",
    ),
    (
        ["--compile", "cudagraphs", "--batch-tokens", "16384"],
        "--compile cudagraphs needs --parallel none and no gradient accumulation",
    ),
    (["--resume"], "--resume: runs/train/checkpoints holds no checkpoint to continue"),
    (["--override", "lr"], "--override needs --resume"),
    (["--resume", "--overwrite"], "exclude each other"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    (["--parallel", "fsdp", "--shard-optimizer"], "does not combine"),
    (["--precision", "bf16-weights", "--parallel", "fsdp"], "--precision bf16-weights does not combine"),
    (["--precision", "bf16-weights", "--shard-optimizer"], "--precision bf16-weights does not combine"),
    (["--precision", "fp8", "--parallel", "fsdp"], "--precision fp8 does not combine with --parallel fsdp"),
    (["--parallel", "ddp"], "--parallel ddp needs torchrun"),
    (["--shard-optimizer"], "--shard-optimizer needs a --parallel mode"),
    (["--bucket-mb", "10"], "--bucket-mb sizes the buckets of --parallel bucketed and torch-ddp and the units of fsdp"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "fsdp" in argv:  # as torchrun sets them
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
    assert loop.main(["--data", str(tmp_path), *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m fastlm.train: error: ") and len(error.splitlines()) == 1
    assert message in error


@pytest.mark.parametrize("mode", ["ddp", "naive", "flat"])
def test_bucket_mb_of_a_mode_without_buckets_is_refused(mode, tmp_path):
    config = TrainConfig(data=tmp_path, parallel=mode, bucket_mb=10.0).resolved(gpu=False)
    with pytest.raises(UserError, match=f"--parallel {mode} has none"):
        config.check(world=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU takes CUDA graphs")
def test_cuda_graphs_without_a_gpu_are_refused(tmp_path, capsys):
    assert loop.main(["--data", str(tmp_path), "--compile", "cudagraphs"]) == 2
    assert "--compile cudagraphs needs a GPU (CUDA graphs)" in capsys.readouterr().err


def test_unprepared_or_too_small_data_is_a_one_line_error(common, tmp_path, capsys):
    assert loop.main(["--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "holds no prepared data (no manifest.json): run fastlm data prepare" in capsys.readouterr().err
    assert loop.main([*common, "--context", "512", "--batch-tokens", "1024", "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert "the held-out split of" in error and "holds 0 window(s) of --context + 1 = 513 tokens" in error


@pytest.fixture
def two_steps(common, tmp_path):
    """A folder holding the checkpoint of a 2-step single-process run, and its arguments."""
    argv = [*common, "--out", str(tmp_path)]
    assert loop.main([*argv, "--steps", "2"]) == 0
    return tmp_path / "checkpoints", argv


def test_an_existing_checkpoint_is_replaced_only_with_overwrite(two_steps, capsys):
    path, argv = two_steps
    committed = checkpoint.newest(path)
    assert loop.main([*argv, "--steps", "1"]) == 2
    assert "holds a run with a checkpoint (step 2): pass --resume to continue it" in capsys.readouterr().err
    assert checkpoint.newest(path) == committed
    assert loop.main([*argv, "--steps", "1", "--overwrite"]) == 0
    assert checkpoint.newest(path)["step"] == 1
    assert not (path / committed["file"]).exists()


def test_resume_refuses_another_configuration_unless_overridden(two_steps, capsys):
    path, argv = two_steps
    assert loop.main([*argv, "--steps", "3", "--resume", "--lr", "0.1", "--batch-tokens", "128"]) == 2
    error = capsys.readouterr().err
    assert (
        "batch_tokens 64 -> 128, lr 0.01 -> 0.1, steps 2 -> 3); pass --override batch_tokens --override lr "
        "--override steps" in error
    )
    assert len(error.splitlines()) == 1
    assert loop.main([*argv, "--steps", "3", "--resume", "--d-model", "32"]) == 2
    assert "d_model (--d-model) cannot change when resuming" in capsys.readouterr().err
    assert loop.main([*argv, "--steps", "3", "--resume", "--context", "8", "--eval-sequences", "8"]) == 2
    assert "context_length (--context) cannot change when resuming" in capsys.readouterr().err
    assert checkpoint.newest(path)["step"] == 2
    # a deliberate change: the new learning rate is the one the optimizer uses from then on
    assert loop.main([*argv, "--steps", "3", "--resume", "--lr", "0.1", "--override", "lr", "--override", "steps"]) == 0
    resumed = checkpoint.load(path)
    assert resumed.step == 3 and resumed.config["lr"] == 0.1
    assert {group["lr"] for group in resumed.state["optimizer"]["param_groups"]} == {0.1}


def test_resume_at_or_past_the_last_step(two_steps, capsys):
    path, argv = two_steps
    committed = checkpoint.newest(path)
    assert loop.main([*argv, "--steps", "2", "--resume"]) == 0
    assert "at step 2 of 2: nothing to train" in capsys.readouterr().out
    assert loop.main([*argv, "--steps", "1", "--resume", "--override", "steps"]) == 2
    assert "is at step 2, past --steps 1" in capsys.readouterr().err
    assert checkpoint.newest(path) == committed


def test_a_corrupt_checkpoint_stops_every_rank_with_one_line(common, tmp_path):
    argv = [*common, "--steps", "3", "--parallel", "ddp", "--out", str(tmp_path)]
    config = loop.parse_args(argv).resolved(gpu=False)
    data = TokenData(config.data)
    record = config.run_record(2, data.sha256, data.tokenizer, data.vocab_size)
    written = checkpoint.save(tmp_path / "checkpoints", 2, record, {"model": {}})
    written.write_bytes(written.read_bytes()[:-1])
    run = TrainRun([*argv, "--resume"], tmp_path / "logs", "corrupt", world=2)
    assert run.wait() == [1, 1]
    size = written.stat().st_size
    for rank in range(2):
        assert run.output(rank).splitlines() == [
            f"python -m fastlm.train: error: {written} is truncated: {size} of {size + 1} bytes"
        ]


def test_under_torchrun_the_failure_summary_names_the_error(tmp_path):
    """torchrun's summary of a failed run ends with a "Root Cause"; it shows the run's one-line error
    (written to torchrun's error file) instead of a link to its documentation."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
        + ["-m", "fastlm.train", "--data", str(tmp_path / "missing"), "--parallel", "ddp", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    root_cause = done.stderr.split("Root Cause")[-1]
    assert f"python -m fastlm.train: error: --data {tmp_path / 'missing'}" in root_cause, done.stderr
    assert "To enable traceback" not in root_cause
