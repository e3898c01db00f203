"""`python -m fastlm.train`: every --parallel mode trains like one process; checkpoints resume exactly."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from fastlm import train
from fastlm.distributed.launch import exit_process, free_port

COMMON = ["--preset", "tiny", "--vocab", "50", "--context", "16", "--lr", "1e-2"]


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    train.main(argv)
    exit_process(0)  # as `python -m fastlm.train` ends


def _torchrun_like(argv: list[str], world: int = 2) -> None:
    mp.spawn(_rank_main, args=(world, free_port(), argv), nprocs=world)


def _weights(path) -> dict:
    return torch.load(path, weights_only=False)["model"]


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
    assert torch.load(path, weights_only=False)["step"] == 2
    assert not path.with_name(path.name + ".tmp").exists()
    _torchrun_like([*argv, "--steps", "3", "--resume"])
    for name, value in _weights(path).items():
        torch.testing.assert_close(value, single_process[name], rtol=1e-4, atol=1e-5, msg=name)


def test_bad_arguments():
    with pytest.raises(SystemExit):
        train.parse_args(["--parallel", "fsdp", "--shard-optimizer"])
    with pytest.raises(SystemExit):
        train.parse_args(["--resume"])
    with pytest.raises(SystemExit, match="needs torchrun"):
        train.train(train.parse_args(["--parallel", "ddp"]))
