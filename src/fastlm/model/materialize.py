"""A model built on the meta device, given memory and the values its constructors would give it.

    with torch.device("meta"):
        model = TransformerLM(config)       # shapes only: no memory, no initialization
    fully_shard(...)                        # optional: FSDP2 shards meta parameters as well
    torch.manual_seed(seed)
    materialize(model, device)              # the same values as TransformerLM(config) on device

Sharded (`torch.distributed.tensor.DTensor` parameters, as FSDP2 leaves them), each parameter is
initialized whole, one at a time, and each rank keeps its shard: the weights equal those of the
unsharded model under the same seed, and no GPU ever holds more than its shards plus the largest
single parameter (a 10b model's fp32 weights, 51 GB, never sit on one GPU). Modules are visited in
registration order, the order their constructors ran in, so the random draws come in the same
sequence (a model whose constructors draw values for modules they then drop, or share parameters
between modules, would not match); every module that holds parameters or buffers directly must
define `reset_parameters`.
"""

from __future__ import annotations

import torch
from torch import nn


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate ``model`` (built on the meta device) on ``device`` and initialize it in place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    for name, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None]
        own += [b for b in module._buffers.values() if b is not None]
        if not own:
            continue
        if not hasattr(module, "reset_parameters"):
            raise TypeError(
                f"{name or 'the model'} ({type(module).__name__}) holds tensors but has no reset_parameters"
            )
        sharded = {key: p for key, p in module._parameters.items() if isinstance(p, DTensor)}
        for key, param in sharded.items():  # the whole tensor for the duration of the initialization
            module._parameters[key] = torch.empty(param.shape, dtype=param.dtype, device=device)
        try:
            with torch.no_grad():
                module.reset_parameters()
                for key, param in sharded.items():
                    # src_data_rank=None: every rank drew the same values, so each cuts its own shard
                    whole = module._parameters[key]
                    shard = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(shard.to_local())
        finally:  # the sharded parameters back in place, also when an initialization fails
            module._parameters.update(sharded)
