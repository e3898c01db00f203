"""What each precision of `fastlm.model.config.PRECISIONS` means for a step (its autocast and its
optimizer's parameter groups), in one place for training, the benchmarks and the profilers:

    fp32          no autocast; weights and optimizer state in fp32
    bf16          torch.autocast(bfloat16) over fp32 weights
    bf16-weights  the same autocast, with every matmul weight stored in bf16 and its fp32 master in
                  fastlm's AdamW (the ``param_dtype`` group of `param_groups`), so no step casts a
                  weight or a weight gradient (docs/optim.md)
    fp8           the same autocast over fp32 weights, the blocks' linear layers through
                  `fastlm.fp8_linear` (`convert_for`: not the LM head, the embedding, the routers)
"""

from __future__ import annotations

import contextlib

import torch

from fastlm.layers.fp8 import ROUTER_NAMES, convert_to_fp8, fits_fp8
from fastlm.layers.linear import Linear, linear_weights
from fastlm.settings import autocasts, stores_bf16_weights, uses_fp8


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast a forward of ``precision`` runs under (none for fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocasts(precision))


def convert_for(model: torch.nn.Module, precision: str) -> list[torch.nn.Module]:
    """For fp8, the linear layers of ``model``'s blocks whose dims fit FP8 (multiples of 16), but
    routers, run `fastlm.fp8_linear` from now on (their instances' forward); returns them (none
    for the other precisions). The weights stay as they are: checkpoints hold the same tensors in
    any precision."""
    if not uses_fp8(precision):
        return []
    layers = [
        module
        for name, module in model.blocks.named_modules()
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in ROUTER_NAMES and fits_fp8(module.weight)
    ]
    for module in layers:
        convert_to_fp8(module)
    return layers


def param_groups(model: torch.nn.Module, precision: str, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: ``weight_decay`` on matrices and embeddings (2-d), none on norm
    weights; for bf16-weights the matmul weights first, in a group stored in bf16 (``param_dtype``,
    for `fastlm.optim.AdamW`). Empty groups are left out."""
    params = list(model.parameters())
    low = linear_weights(model) if stores_bf16_weights(precision) else []
    low_ids = {id(p) for p in low}
    groups = [
        {"params": low, "weight_decay": weight_decay, "param_dtype": torch.bfloat16},
        {"params": [p for p in params if p.dim() >= 2 and id(p) not in low_ids], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
