"""The experts of a mixture of experts, each token's gated MLPs weighted and summed by
`fastlm.ops.moe.moe_experts`, under autocast as PyTorch's loop over the experts runs there."""

from __future__ import annotations

import torch

from fastlm.ops.moe import moe_experts


def experts_output(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """`moe_experts` (its shapes) in x's dtype. Under autocast the tokens and expert weights go in
    the autocast dtype, as F.linear would cast them, and the routing weights in fp32 (the kernels
    sum each token's K outputs in fp32)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return moe_experts(x, gate_up, down, top_k_index, top_k_weights, activation)
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        out = moe_experts(
            x.to(dtype), gate_up.to(dtype), down.to(dtype), top_k_index, top_k_weights.float(), activation
        )
    return out.to(x.dtype)
