"""The parallel modes as objects: one per name of `fastlm.settings.PARALLEL`, each preparing the model
in its own order and counting the state each process holds; the configuration reads the modes'
vocabulary without the runtime modules. (Training in every mode: test_wrappers.py, test_train.py.)"""

import subprocess
import sys

import pytest
import torch

from fastlm.distributed.wrappers import MODES, Wrapped, parallel_mode
from fastlm.settings import PARALLEL, STATE_BYTES, ParallelSpec

CPU = torch.device("cpu")


def test_every_mode_of_the_vocabulary_has_one_object():
    assert tuple(MODES) == tuple(PARALLEL)
    assert parallel_mode(ParallelSpec("ddp")).spec == ParallelSpec("ddp")
    assert type(parallel_mode(ParallelSpec("naive"))) is not type(parallel_mode(ParallelSpec("flat")))


def _prepare(mode, optimizer_first: bool) -> list[str]:
    """The steps ``mode.prepare`` takes, in order, and on which module each ran."""
    model = torch.nn.Linear(2, 2)
    steps = []

    def step(name: str, result=None):
        return lambda module: steps.append(f"{name} {'wrapped' if module is not model else 'model'}") or result

    prepared, optimizer = mode.prepare(
        model,
        CPU,
        None,
        materialize=step("materialize"),
        compile=step("compile"),
        optimizer=step("optimizer", "the optimizer"),
        optimizer_first=optimizer_first,
    )
    assert optimizer == "the optimizer"
    return steps


def _wrapped_in_a_box(self, model, device, compute_dtype) -> Wrapped:
    return Wrapped(torch.nn.Sequential(model), lambda: None)  # stands in for FSDP's root, without a process group


@pytest.mark.parametrize(
    ("name", "optimizer_first", "expected"),
    [
        # every rank holds the whole model: materialized first, compiled as wrapped
        ("none", False, ["materialize model", "compile wrapped", "optimizer wrapped"]),
        # bf16-weights: the optimizer stores the weights in bf16 before the wrapper sizes its buckets
        ("bucketed", True, ["materialize model", "optimizer model", "compile wrapped"]),
        # the blocks compile before FSDP's hooks go around them; only the shards are materialized
        ("fsdp", False, ["compile model", "materialize wrapped", "optimizer wrapped"]),
    ],
)
def test_each_mode_prepares_in_its_order(name, optimizer_first, expected, monkeypatch):
    monkeypatch.setattr(MODES[name], "wrap", _wrapped_in_a_box)
    spec = ParallelSpec(name, 1.0 if PARALLEL[name].needs_bucket_mb else None)
    assert _prepare(parallel_mode(spec), optimizer_first) == expected


def test_fsdp_builds_no_optimizer_before_it_replaces_the_parameters():
    with pytest.raises(ValueError, match="build the optimizer after wrapping"):
        _prepare(parallel_mode(ParallelSpec("fsdp")), optimizer_first=True)


@pytest.mark.parametrize(
    ("spec", "precision", "world", "expected"),
    [
        (ParallelSpec("none"), "bf16", 1, 16),  # fp32 weights 4 + gradients 4 + AdamW moments 8
        (ParallelSpec("ddp"), "fp32", 4, 16),  # each replica holds all of it
        (ParallelSpec("ddp", shard_optimizer=True), "fp32", 4, 4 + 4 + 8 / 4),
        (ParallelSpec("torch-ddp", shard_optimizer=True), "bf16-weights", 2, 2 + 2 + 12 / 2),  # masters in AdamW
        (ParallelSpec("fsdp"), "bf16", 4, 16 / 4),  # everything sharded
    ],
)
def test_state_bytes_per_parameter(spec, precision, world, expected):
    assert parallel_mode(spec).state_bytes_per_parameter(STATE_BYTES[precision], world) == expected


@pytest.mark.parametrize("mode", ["none", "fsdp"])
def test_a_spec_refuses_a_sharded_optimizer_where_there_is_none_to_add(mode):
    with pytest.raises(ValueError, match=f"parallel mode {mode} takes no shard_optimizer"):
        ParallelSpec(mode, shard_optimizer=True)


def test_the_training_configuration_needs_no_distributed_module():
    code = (
        "import sys; import fastlm.train.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('fastlm.distributed', 'torch'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
