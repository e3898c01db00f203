"""`--parallel fsdp` as `fastlm.distributed.wrappers` builds it, on 2 gloo ranks: under bf16
autocast the blocks are gathered in bf16 and train like one process does under the same autocast
(up to bf16 rounding), whether the blocks keep their gathered weights from forward to backward or
gather them again; an evaluation after an optimizer step sees the new weights, and so does the next
step's forward, which reuses the weights the evaluation left gathered."""

import copy
import dataclasses

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fastlm.distributed import wrappers
from fastlm.distributed.wrappers import ParallelSpec, keeps_gathered, wrap
from fastlm.model import ModelConfig, TransformerLM

from . import ranks

WORLD = 2
CPU = torch.device("cpu")
CONFIG = ModelConfig.preset("tiny", vocab_size=64, context_length=8)
BF16 = torch.bfloat16


def _forward(model, tokens, targets):
    with torch.autocast("cpu", dtype=BF16):
        return model(tokens, targets)


def _train_like_one_process(rank: int, limit: int) -> None:
    default, wrappers.GATHERED_BYTES_LIMIT = wrappers.GATHERED_BYTES_LIMIT, limit  # this rank's copy of the module
    try:
        _train_like_one_process_under_the_limit(rank)
    finally:  # the ranks serve later tests
        wrappers.GATHERED_BYTES_LIMIT = default


def _train_like_one_process_under_the_limit(rank: int) -> None:
    shape = (3, 2 * WORLD, CONFIG.context_length + 1)  # two training batches and one held out
    data = torch.randint(0, CONFIG.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    reference = copy.deepcopy(model)
    root = wrap(model, ParallelSpec("fsdp"), CPU, BF16).module
    blocks = list(model.blocks)
    seen = {}  # the dtype of the weights a forward computes with

    def record(name):
        def hook(module, inputs, output) -> None:
            seen[name] = module.weight.dtype

        return hook

    blocks[0].attention.q_proj.register_forward_hook(record("block"))
    model.embedding.register_forward_hook(record("embedding"))
    sharded = list(root.parameters())  # what the optimizer updates (after a forward the model may hold gathered ones)
    optimizers = [torch.optim.SGD(sharded, lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)]
    mine = slice(2 * rank, 2 * rank + 2)  # each rank takes its half of the batch
    for step, batch in enumerate(data[:2]):
        tokens, targets = batch[:, :-1], batch[:, 1:]
        loss = _forward(root, tokens[mine], targets[mine])
        # after forward: the gathered weights stay only where backward is spared a second gather
        kept = [not isinstance(block.attention.q_proj.weight, DTensor) for block in blocks]
        assert kept == [keeps_gathered(model, BF16) or block is blocks[-1] for block in blocks], kept
        loss.backward()
        _forward(reference, tokens, targets).backward()  # the mean over the whole batch
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # an evaluation between steps: it must see this step's weights
            tokens, targets = data[2, :, :-1], data[2, :, 1:]
            evaluated = _forward(root, tokens[mine], targets[mine]).float()
            torch.distributed.all_reduce(evaluated)
            expected = _forward(reference, tokens, targets).float()
            torch.testing.assert_close(evaluated / WORLD, expected, rtol=1e-3, atol=0, msg=f"step {step}")
    assert seen == {"block": BF16, "embedding": torch.float32}, seen
    # the blocks' norm weights enter the forward rounded to bf16 (autocast multiplies them in fp32)
    for p, (name, q) in zip(sharded, reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), rtol=0, atol=1e-3, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("limit", [wrappers.GATHERED_BYTES_LIMIT, 0], ids=["kept-gathered", "gathered-again"])
def test_fsdp_under_bf16_autocast_trains_like_one_process(limit):
    ranks.run(_train_like_one_process, limit)


def test_only_small_models_keep_their_gathered_weights(monkeypatch):
    model = TransformerLM(CONFIG)
    block_bytes = sum(p.numel() for p in model.blocks.parameters()) * 2
    monkeypatch.setattr(wrappers, "GATHERED_BYTES_LIMIT", block_bytes)
    assert keeps_gathered(model, BF16)
    assert not keeps_gathered(model, None)  # fp32: twice the bytes
    assert not keeps_gathered(model, torch.float32)


def test_sharding_units_group_consecutive_blocks_up_to_a_size():
    """Units of at least unit_mb MB of gathered weights, in order, the remainder joining the last."""
    model = TransformerLM(ModelConfig.preset("tiny", num_layers=5, vocab_size=64, context_length=8))
    blocks = list(model.blocks)
    block_mb = sum(p.numel() for p in blocks[0].parameters()) * 2 / 1e6  # in bf16, MB of 1e6 bytes
    assert wrappers.sharding_units(blocks, None, BF16) == [[b] for b in blocks]
    assert wrappers.sharding_units(blocks, 2 * block_mb, BF16) == [blocks[0:2], blocks[2:5]]
    assert wrappers.sharding_units(blocks, 1.5 * block_mb, torch.float32) == [[b] for b in blocks]
    assert wrappers.sharding_units(blocks, 100 * block_mb, BF16) == [blocks]


def _grouped_units_train_like_one_process(rank: int, recompute: bool, blocks_per_unit: int) -> None:
    torch.manual_seed(0)
    model = TransformerLM(dataclasses.replace(CONFIG, num_layers=4, recompute=recompute))
    reference = copy.deepcopy(model)
    unit_mb = sum(p.numel() for p in model.blocks[0].parameters()) * 4 * blocks_per_unit / 1e6  # fp32 blocks
    root = wrap(model, ParallelSpec("fsdp", unit_mb), CPU).module
    # all blocks in one unit: the stack is the FSDP module (the loop compiles it as one graph)
    assert isinstance(model.blocks, FSDPModule) == (blocks_per_unit == 4)
    data = torch.randint(0, CONFIG.vocab_size, (2 * WORLD, CONFIG.context_length + 1))
    mine = slice(2 * rank, 2 * rank + 2)
    root(data[mine, :-1], data[mine, 1:]).backward()
    reference(data[:, :-1], data[:, 1:]).backward()
    for p, (name, q) in zip(root.parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("blocks_per_unit", [2, 4], ids=["two-units", "the-stack"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_grouped_units_give_the_gradients_of_one_process(recompute, blocks_per_unit):
    """Two units of two blocks, or all four blocks as one unit (the stack
    module itself); also with activation checkpointing, whose backward runs the forwards again."""
    ranks.run(_grouped_units_train_like_one_process, recompute, blocks_per_unit)
