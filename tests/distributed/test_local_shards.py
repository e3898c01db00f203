"""`fastlm.distributed.local_shards` on 2 gloo ranks of a model under `--parallel fsdp`: its
gradient clipping gives the norm and the gradients of PyTorch's `clip_grad_norm_` on the DTensors,
clipping or not; its AdamW steps to the parameters and the (checkpointed) state of
torch.optim.AdamW on the DTensors, fused or not, and takes over torch.optim.AdamW's state."""

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim import adam as torch_adam

from fastlm.distributed import local_shards
from fastlm.distributed.wrappers import ParallelSpec, wrap
from fastlm.model import TransformerLM
from fastlm.model.precision import param_groups

from . import ranks
from .test_fsdp import CONFIG, CPU, WORLD

FULL = StateDictOptions(full_state_dict=True)


def _fsdp_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and for every call
    return wrap(TransformerLM(CONFIG), ParallelSpec("fsdp"), CPU).module


def _backward(model: torch.nn.Module, rank: int, seed: int) -> None:
    """Gradients of this rank's half of a batch that depends on ``seed`` only."""
    data = torch.randint(
        0, CONFIG.vocab_size, (2 * WORLD, CONFIG.context_length + 1), generator=torch.Generator().manual_seed(seed)
    )
    mine = data[2 * rank : 2 * rank + 2]
    model(mine[:, :-1], mine[:, 1:]).backward()


def _clip_like_pytorch(rank: int) -> None:
    model = _fsdp_model()
    _backward(model, rank, seed=1)
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf).full_tensor()
    for max_norm in (norm.item() / 3, math.inf, 10 * norm.item()):  # clipping, then twice not
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).full_tensor()
        expected = [p.grad.full_tensor() for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        norm = local_shards.clip_grad_norm_(params, max_norm)
        assert not isinstance(norm, DTensor) and norm.dtype == torch.float32
        torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0, msg=f"max_norm {max_norm}")
        for p, grad in zip(params, expected, strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), grad, rtol=1e-6, atol=0, msg=f"max_norm {max_norm}")
    # a replicated gradient lies whole on every rank: its square would be summed twice
    params[0].grad = distribute_tensor(grads[0].full_tensor(), grads[0].device_mesh, [Replicate()])
    with pytest.raises(ValueError, match="takes gradients sharded on one 1-D device mesh"):
        local_shards.clip_grad_norm_(params, 1.0)


def test_clipping_the_local_shards_is_pytorchs_clipping():
    ranks.run(_clip_like_pytorch)


def test_clipping_refuses_unsharded_gradients():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="got a plain tensor"):
        local_shards.clip_grad_norm_([p], 1.0)


def _optimizer(model, optimizer_cls, fused: bool) -> torch.optim.Optimizer:
    return optimizer_cls(param_groups(model, "fp32", 0.1), lr=1e-2, betas=(0.9, 0.95), fused=fused)


def _assert_same_training_state(model, optimizer, reference, reference_optimizer, message: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), f"{message}: {name}"
    (model_state, state), (expected_model_state, expected) = (
        get_state_dict(m, o, options=FULL) for m, o in ((model, optimizer), (reference, reference_optimizer))
    )
    torch.testing.assert_close(model_state, expected_model_state, rtol=0, atol=0, msg=message)
    torch.testing.assert_close(state["state"], expected["state"], rtol=0, atol=0, msg=message)
    groups, expected_groups = ([{**g, "betas": list(g["betas"])} for g in s["param_groups"]] for s in (state, expected))
    assert groups == expected_groups, message  # (set_state_dict loads the betas as a list)


def _step_like_pytorch(rank: int, fused: bool) -> None:
    update, updated = torch_adam.adam, []  # the function Adam's step hands its tensors to

    def recording(params, *args, **kwargs):
        updated.append(isinstance(params[0], DTensor))
        return update(params, *args, **kwargs)

    torch_adam.adam = recording  # in this rank's process only
    try:
        _step_like_pytorch_recording(rank, fused, updated)
    finally:  # the ranks serve later tests
        torch_adam.adam = update


def _step_like_pytorch_recording(rank: int, fused: bool, updated: list[bool]) -> None:
    model, reference = _fsdp_model(), _fsdp_model()
    optimizer = _optimizer(model, local_shards.AdamW, fused)
    reference_optimizer = _optimizer(reference, torch.optim.AdamW, fused)
    for step in range(3):
        for m, o in ((model, optimizer), (reference, reference_optimizer)):
            _backward(m, rank, seed=step)
            o.step()
            o.zero_grad(set_to_none=True)
        _assert_same_training_state(model, optimizer, reference, reference_optimizer, f"step {step + 1}")
    # per step and param group: local_shards.AdamW updates plain tensors, torch.optim.AdamW DTensors
    assert updated == 3 * (2 * [False] + 2 * [True]), updated
    exp_avg = next(iter(optimizer.state.values()))["exp_avg"]
    assert isinstance(exp_avg, DTensor), type(exp_avg)
    # torch.optim.AdamW's checkpoint continues in a fresh local_shards.AdamW as in torch.optim.AdamW
    resumed = _fsdp_model()
    resumed_optimizer = _optimizer(resumed, local_shards.AdamW, fused)
    # copied, as a checkpoint's file is: the state dict holds the reference's own `step` tensors
    model_state, optimizer_state = copy.deepcopy(get_state_dict(reference, reference_optimizer, options=FULL))
    set_state_dict(
        resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=FULL
    )
    for m, o in ((resumed, resumed_optimizer), (reference, reference_optimizer)):
        _backward(m, rank, seed=3)
        o.step()
    _assert_same_training_state(resumed, resumed_optimizer, reference, reference_optimizer, "resumed")


@pytest.mark.parametrize("fused", [False, True], ids=["single-tensor", "fused"])
def test_adamw_on_the_local_shards_steps_like_pytorchs(fused):
    ranks.run(_step_like_pytorch, fused)
