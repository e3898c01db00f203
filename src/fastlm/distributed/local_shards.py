"""`--parallel fsdp`'s gradient clipping and AdamW step on the local shards: plain tensors, not DTensors.

Under FSDP2 (`fully_shard`) every parameter, gradient and AdamW moment is a DTensor. Each op on a
DTensor first runs DTensor's dispatcher on the host (sharding propagation, placement checks,
wrapping the results), then the same op on the local tensors. `fastlm train --preset small
--parallel fsdp` on 2 H100s is host-bound, and its profile put about 10 ms of host time per step in
AdamW's step over the DTensors alone, besides `clip_grad_norm_`'s (docs/notes/distributed.md). Both
updates are elementwise, or a sum, so they run on the local shards here:

- `clip_grad_norm_`: the squared 2-norms of the local gradient shards (fp32), summed, one
  all-reduce (SUM) over the shard group, sqrt: the global norm; then the local gradients scaled in
  place, as `torch.nn.utils.clip_grads_with_norm_` does.
- `AdamW`: a `torch.optim.AdamW` over the DTensor parameters whose state stays PyTorch's (DTensor
  moments, plain `step` tensors), so `state_dict` and `torch.distributed.checkpoint.state_dict`
  see a torch.optim.AdamW and checkpoints of either load into the other; its step runs PyTorch's
  own update on the local tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (call under no_grad: then no autograd view), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_group(grads: list[torch.Tensor]) -> dist.ProcessGroup:
    """The process group over which ``grads`` are sharded: each must be a DTensor of one 1-D device
    mesh with a Shard placement (FSDP2's layout), so every element lies on exactly one rank. A
    replicated gradient would be counted once per rank: refused rather than handled."""
    mesh = grads[0].device_mesh if isinstance(grads[0], DTensor) else None
    for grad in grads:
        if not isinstance(grad, DTensor):
            raise ValueError(f"clip_grad_norm_ takes FSDP2's DTensor gradients, got a plain tensor {tuple(grad.shape)}")
        if grad.device_mesh != mesh or mesh.ndim != 1 or not grad.placements[0].is_shard():
            raise ValueError(
                "clip_grad_norm_ takes gradients sharded on one 1-D device mesh (FSDP2's fully_shard), "
                f"got placements {grad.placements} on {grad.device_mesh}"
            )
    return mesh.get_group()


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of FSDP2-sharded ``parameters`` to a global 2-norm of at most ``max_norm``
    (inf: no limit), in place; the norm before, an fp32 plain tensor, the same on every rank. The
    result of `torch.nn.utils.clip_grad_norm_` on the DTensors, up to rounding. Every rank of the
    shard group must call it (one all-reduce)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    group = _shard_group(grads)
    local = [_local(grad) for grad in grads]
    # torch's private multi-tensor ops, as clip_grad_norm_ uses them (no public one launches once for all)
    norms = torch._foreach_norm(local, 2.0, dtype=torch.float32)
    squared = torch.stack(norms).square().sum()
    dist.all_reduce(squared, group=group)  # every element lies on one rank: the sum is the global one
    norm = squared.sqrt()
    # clip_grads_with_norm_'s scale; multiplying by a clamped 1 too spares the host a sync on the norm
    torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose update (fused, foreach or single-tensor, as the options pick) runs on
    the local tensors of DTensor parameters, gradients and states: PyTorch's own arithmetic on the
    same values, without DTensor's dispatch. The states are created and kept as torch.optim.AdamW's.

    Relies on a private method, for want of a public seam between gathering a group's tensors and
    updating them: torch.optim.Adam's step calls ``_init_group(group, params, grads, exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs, state_steps)``, which creates the missing states and appends each
    parameter's tensors to those lists, then hands the lists to the update. Should PyTorch rename
    it, this override goes uncalled and the step runs on the DTensors: slower, not wrong
    (tests/distributed/test_local_shards.py checks that the update gets plain tensors)."""

    def _init_group(self, group: dict, *tensor_lists: list[torch.Tensor]) -> bool:
        has_complex = super()._init_group(group, *tensor_lists)
        for tensors in tensor_lists:  # in place: the update reads these very lists
            if isinstance(tensors, list):  # torch < 2.7 passes AdamW's amsgrad flag among them
                # step's no_grad: to_local gives views of the shards, which the update changes in place
                tensors[:] = [_local(t) for t in tensors]
        return has_complex
