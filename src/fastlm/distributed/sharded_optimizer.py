"""`ShardedOptimizer`: optimizer-state sharding (the optimizer half of ZeRO stage 1).

Every rank keeps all parameters and computes all gradients (as in plain data parallelism, after
the gradients were averaged), but each parameter is *owned* by one rank: only its owner keeps the
optimizer state for it (AdamW: two fp32 moments, 8 bytes per parameter) and updates it; the owner
then broadcasts the updated parameter to the other ranks. Optimizer-state memory per rank falls
from 8N to about 8N / world bytes, at the cost of one broadcast of every parameter per step (the
same volume as the all-gather of ZeRO-1).

Ownership is assigned greedily as parameters arrive (constructor and `add_param_group`): each goes
to the rank that owns the fewest elements so far, the same decision on every rank since all see the
same parameters in the same order. Each rank wraps its share in an ordinary `optimizer_cls`.
`state_dict()` gathers every rank's share into the layout of an unsharded optimizer (the same on
every rank); `load_state_dict()` gives each rank back its share, so checkpoints are interchangeable
with those of `optimizer_cls` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


def _options(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    return value


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owner: dict[int, int] = {}  # id(param) -> owning rank
        self.owned_elements = [0] * self.world
        self.local: torch.optim.Optimizer | None = None  # this rank's share, built by add_param_group
        super().__init__(params, defaults=kwargs)

    def add_param_group(self, param_group: dict) -> None:
        """Register the group with every rank's view, assign its parameters to owners and give this
        rank's share to the local optimizer (also during training)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for param in group["params"]:
            rank = min(range(self.world), key=lambda r: self.owned_elements[r])
            self.owner[id(param)] = rank
            self.owned_elements[rank] += param.numel()
            if rank == self.rank:
                mine.append(param)
        local_group = {**_options(group), "params": mine}
        if self.local is None:
            self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local.add_param_group(local_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's share, then broadcast every parameter from its owner."""
        for group, local_group in zip(self.param_groups, self.local.param_groups, strict=True):
            local_group.update(_options(group))  # hyperparameters set on this wrapper (schedulers)
        loss = self.local.step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                dist.broadcast(param, src=self.owner[id(param)])
        return loss

    def _global_index(self) -> dict[int, int]:
        """id(param) -> its index in the unsharded optimizer's state_dict layout."""
        params = [p for group in self.param_groups for p in group["params"]]
        return {id(p): i for i, p in enumerate(params)}

    def state_dict(self) -> dict:
        """The whole optimizer's state, gathered from every rank (a collective: call on all ranks)."""
        index = self._global_index()
        local = self.local.state_dict()
        local_params = [p for group in self.local.param_groups for p in group["params"]]
        mine = {index[id(p)]: _to_cpu(local["state"][i]) for i, p in enumerate(local_params) if i in local["state"]}
        shares: list = [None] * self.world
        dist.all_gather_object(shares, mine)
        state = {k: v for share in shares for k, v in share.items()}
        groups = [  # the local groups carry every option with its default filled in, as optimizer_cls reports them
            {**_options(local_group), "params": [index[id(p)] for p in group["params"]]}
            for group, local_group in zip(self.param_groups, self.local.param_groups, strict=True)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from `state_dict()` (or from an unsharded optimizer of the same parameters)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} parameter groups, this optimizer {len(self.param_groups)}"
            )
        index = self._global_index()
        local_groups, local_state, position = [], {}, 0
        for group, saved, local_group in zip(self.param_groups, saved_groups, self.local.param_groups, strict=True):
            group.update(_options(saved))
            ids = []
            for param in local_group["params"]:
                if index[id(param)] in state_dict["state"]:
                    local_state[position] = state_dict["state"][index[id(param)]]
                ids.append(position)
                position += 1
            local_groups.append({**_options(saved), "params": ids})
        self.local.load_state_dict({"state": local_state, "param_groups": local_groups})
