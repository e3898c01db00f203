"""The registry of data-parallel wrappers: specs are checked, and every mode trains the LM on 2 gloo
ranks exactly as one process does on the whole batch."""

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch

from fastlm.distributed.wrappers import (
    COMPILED_BUCKETED_MB,
    DEFAULT_BUCKET_MB,
    MODES,
    ParallelSpec,
    bucket_mb_in_use,
    wrap,
)
from fastlm.model import ModelConfig, TransformerLM

from . import ranks

WORLD = 2
CPU = torch.device("cpu")
CONFIG = ModelConfig.preset("tiny", vocab_size=64, context_length=8)
# every mode that averages gradients; torch-ddp both with PyTorch's bucket size and with one given
SYNCHRONIZING = [
    ParallelSpec("naive"),
    ParallelSpec("flat"),
    ParallelSpec("ddp"),
    ParallelSpec("bucketed", 0.01),
    ParallelSpec("torch-ddp"),
    ParallelSpec("torch-ddp", 0.01),
    ParallelSpec("fsdp"),
]


@pytest.mark.parametrize(
    ("mode", "bucket_mb", "message"),
    [
        ("pipeline", None, "unknown parallel mode 'pipeline'"),
        ("bucketed", None, "needs bucket_mb"),
        ("ddp", 25.0, "takes no bucket_mb"),
        ("bucketed", 0.0, "positive finite"),
        ("torch-ddp", float("inf"), "positive finite"),
    ],
)
def test_a_bad_spec_is_one_sentence(mode, bucket_mb, message):
    with pytest.raises(ValueError, match=message):
        ParallelSpec(mode, bucket_mb)


@pytest.mark.parametrize(
    ("mode", "bucket_mb", "compiled", "expected"),
    [
        ("bucketed", None, False, DEFAULT_BUCKET_MB["bucketed"]),  # eager: buckets overlap backward
        ("bucketed", None, True, COMPILED_BUCKETED_MB),  # one graph: nothing to overlap, fewer calls
        ("bucketed", 10.0, True, 10.0),  # a size given always wins
        ("torch-ddp", None, True, DEFAULT_BUCKET_MB["torch-ddp"]),  # splits its graph at its buckets
        ("fsdp", None, True, DEFAULT_BUCKET_MB["fsdp"]),
        ("ddp", None, True, None),
    ],
)
def test_bucket_sizes_in_use(mode, bucket_mb, compiled, expected):
    assert bucket_mb_in_use(mode, bucket_mb, compiled) == expected


def test_the_command_line_parses_a_spec_without_torch():
    code = "import sys; from fastlm.distributed.wrappers import ParallelSpec; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


def test_none_is_the_model_itself():
    model = torch.nn.Linear(2, 2)
    wrapped = wrap(model, ParallelSpec("none"), CPU)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    wrapped.synchronize()
    assert wrapped.module is model and torch.equal(model.weight.grad, before)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP parameter (a DTensor shard) gathered whole; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _every_mode_matches_one_process(rank: int) -> None:
    data = torch.randint(
        0, CONFIG.vocab_size, (2 * WORLD, CONFIG.context_length + 1), generator=torch.Generator().manual_seed(1)
    )
    tokens, targets = data[:, :-1], data[:, 1:]
    mine = slice(2 * rank, 2 * rank + 2)  # each rank takes its half of the batch
    for spec in SYNCHRONIZING:
        torch.manual_seed(0)
        model = TransformerLM(CONFIG)
        reference = copy.deepcopy(model)
        wrapped = wrap(model, spec, CPU)
        optimizer = torch.optim.SGD(wrapped.module.parameters(), lr=0.5)  # after wrapping: FSDP's sharded params
        wrapped.module(tokens[mine], targets[mine]).backward()
        wrapped.synchronize()
        optimizer.step()
        reference(tokens, targets).backward()  # the mean over the whole batch: the mean of the halves' means
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(
                _full(p.detach()), q.detach(), rtol=1e-4, atol=1e-6, msg=f"{spec} rank {rank}: {name}"
            )


def test_every_mode_trains_like_one_process():
    assert {spec.mode for spec in SYNCHRONIZING} == set(MODES) - {"none"}
    ranks.run(_every_mode_matches_one_process)


def _bf16_reduction_averages_in_bf16(rank: int) -> None:
    data = torch.randint(
        0, CONFIG.vocab_size, (2 * WORLD, CONFIG.context_length + 1), generator=torch.Generator().manual_seed(1)
    )
    tokens, targets = data[:, :-1], data[:, 1:]
    mine = slice(2 * rank, 2 * rank + 2)
    for spec in SYNCHRONIZING:
        spec = dataclasses.replace(spec, reduce_dtype="bf16")
        torch.manual_seed(0)
        model = TransformerLM(CONFIG)
        reference = copy.deepcopy(model)
        wrapped = wrap(model, spec, CPU)
        wrapped.module(tokens[mine], targets[mine]).backward()
        wrapped.synchronize()
        reference(tokens, targets).backward()
        for (name, p), q in zip(wrapped.module.named_parameters(), reference.parameters(), strict=True):
            grad = _full(p.grad)
            # a bf16 sum over 2 ranks, halved exactly: every averaged value is a bf16 number
            assert torch.equal(grad, grad.bfloat16().float()), f"{spec} {name}: not reduced in bf16"
            scale = q.grad.abs().max()
            torch.testing.assert_close(grad / scale, q.grad / scale, rtol=0, atol=2**-7, msg=f"{spec} {name}")


def test_bf16_reduction_averages_the_gradients_in_bf16():
    ranks.run(_bf16_reduction_averages_in_bf16)


def test_bf16_reduction_needs_a_mode_that_averages():
    with pytest.raises(ValueError, match="reduce_dtype must stay fp32"):
        ParallelSpec("none", reduce_dtype="bf16")
    with pytest.raises(ValueError, match="reduce_dtype must be one of fp32, bf16"):
        ParallelSpec("ddp", reduce_dtype="fp16")
