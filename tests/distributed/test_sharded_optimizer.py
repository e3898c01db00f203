"""ShardedOptimizer on 2 gloo ranks: same training as an unsharded optimizer, state sharded and restorable."""

import pytest
import torch
from torch import nn

from fastlm.distributed import ShardedOptimizer

from . import ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _steps(model, optimizer, data, steps) -> None:
    for step in steps:
        model(data[step]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _matches_unsharded(rank: int, tmp: str) -> None:
    data = torch.randn(13, 8, 6, generator=torch.Generator().manual_seed(1))
    model, reference = _model(), _model()
    first, rest = list(model[0].parameters()), [p for m in (model[2], model[4]) for p in m.parameters()]
    sharded = ShardedOptimizer(iter(first), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)  # a generator of params
    sharded.add_param_group({"params": rest, "lr": 5e-3})  # a second group, with its own lr
    ref_optimizer = torch.optim.AdamW(list(reference[0].parameters()), lr=1e-2, weight_decay=0.1)
    ref_optimizer.add_param_group(
        {"params": [p for m in (reference[2], reference[4]) for p in m.parameters()], "lr": 5e-3}
    )
    # gradients are identical on both ranks here (same data), as they are after DDP averaging
    _steps(model, sharded, data, range(10))
    _steps(reference, ref_optimizer, data, range(10))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)  # bit for bit: the owner runs the same elementwise update, then broadcasts
    # each rank keeps state only for the parameters it owns, and the two shares are balanced
    owned = [p for g in sharded.local.param_groups for p in g["params"]]
    assert 0 < len(sharded.local.state) == len(owned) < len(list(model.parameters()))
    assert abs(sharded.owned_elements[0] - sharded.owned_elements[1]) <= 16 * 16
    # the consolidated state dict equals the unsharded optimizer's
    state, expected = sharded.state_dict(), ref_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert sorted(state["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value.cpu())
    # restore into a fresh sharded optimizer: training goes on exactly as the reference's
    if rank == 0:
        torch.save(state, f"{tmp}/optimizer.pt")
    torch.distributed.barrier()
    restored_model = _model()
    restored_model.load_state_dict(model.state_dict())
    restored = ShardedOptimizer(restored_model[0].parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    restored.add_param_group(
        {"params": [p for m in (restored_model[2], restored_model[4]) for p in m.parameters()], "lr": 5e-3}
    )
    restored.load_state_dict(torch.load(f"{tmp}/optimizer.pt"))
    _steps(restored_model, restored, data, range(10, 13))
    _steps(reference, ref_optimizer, data, range(10, 13))
    for p, q in zip(restored_model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_sharded_training_matches_and_state_round_trips(tmp_path):
    ranks.run(_matches_unsharded, str(tmp_path))


def _none_grads_and_late_groups(rank: int) -> None:
    model = _model()
    sharded = ShardedOptimizer(model[0].parameters(), torch.optim.SGD, lr=0.1)
    model[0](torch.randn(2, 6)).sum().backward()
    sharded.step()  # fine before the other layers exist in the optimizer
    unused = nn.Parameter(torch.ones(4))  # never gets a gradient
    sharded.add_param_group({"params": [*model[2].parameters(), unused]})
    before = unused.detach().clone()
    model[2](torch.randn(2, 16)).sum().backward()
    sharded.step()
    torch.testing.assert_close(unused, before)
    assert len(sharded.param_groups) == 2


def test_parameters_without_gradients_and_groups_added_during_training():
    ranks.run(_none_grads_and_late_groups)


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
