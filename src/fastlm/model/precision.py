"""What each precision of `fastlm.model.config.PRECISIONS` means for a step (its autocast and its
optimizer's parameter groups), in one place for training, the benchmarks and the profilers:

    fp32          no autocast; weights and optimizer state in fp32
    bf16          torch.autocast(bfloat16) over fp32 weights
    bf16-weights  the same autocast, with every matmul weight stored in bf16 and its fp32 master in
                  fastlm's AdamW (the ``param_dtype`` group of `param_groups`), so no step casts a
                  weight or a weight gradient (docs/optim.md)
"""

from __future__ import annotations

import contextlib

import torch

from fastlm.layers.linear import linear_weights
from fastlm.settings import autocasts, stores_bf16_weights


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast a forward of ``precision`` runs under (none for fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocasts(precision))


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
