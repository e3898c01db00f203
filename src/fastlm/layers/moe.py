"""A mixture of experts in place of a dense MLP: a router picks each token's K of E experts, the
experts' SwiGLU MLPs run over the tokens routed to them (`fastlm.ops.moe.moe_experts`), and their
outputs are summed with the routing weights; shared experts, if any, see every token.

    x (B, N, d) -> router logits (T, E), T = B N -> softmax over E, the K largest, renormalized
      -> sum_j w[t, j] down[e_j](silu(gate[e_j] x_t) * up[e_j] x_t)   (+ shared(x_t))

`MoEMLP` returns the routers' statistics beside its output (`RouterStatistics`): the model adds the
load-balancing loss to its training loss and keeps the counts for the log.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from fastlm.layers.linear import Linear, trunc_normal_
from fastlm.layers.mlp import SwiGLUMLP
from fastlm.layers.norms import check_kernel
from fastlm.ops.moe import expert_counts, load_balancing_loss, moe_experts, moe_experts_ref, route, router_z_loss


def experts_output(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
    fused: bool = True,
) -> torch.Tensor:
    """`moe_experts` (its shapes; ``fused=False``: `moe_experts_ref`, the loop over the experts) in
    x's dtype. Under autocast the tokens and expert weights go in the autocast dtype, as F.linear
    would cast them, and the routing weights in fp32 (the kernels sum each token's K outputs in fp32)."""
    experts = moe_experts if fused else moe_experts_ref
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return experts(x, gate_up, down, top_k_index, top_k_weights, activation)
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        out = experts(x.to(dtype), gate_up.to(dtype), down.to(dtype), top_k_index, top_k_weights.float(), activation)
    return out.to(x.dtype)


class RouterStatistics(NamedTuple):
    """One MoE layer's forward: its load-balancing loss (0-dim fp32, `load_balancing_loss`: K when
    balanced), its z-loss (0-dim fp32, `router_z_loss`) and the choices per expert (E,) int64."""

    balance: torch.Tensor
    z: torch.Tensor
    counts: torch.Tensor


class MoEMLP(nn.Module):
    """(B, N, d) -> (B, N, d) and the layer's `RouterStatistics`: E experts of hidden width
    ``expert_d_ff``, K of them per token (module docstring), plus ``shared_experts`` experts' worth
    of a dense SwiGLU MLP (width shared_experts x expert_d_ff) that every token passes through.

    Weights: router (E, d); gate_up (E, 2I, d), expert e's gate rows [0, I) and up rows [I, 2I);
    down (E, d, I); each expert initialized as `Linear` of its shape. ``kernel``: "torch" runs the
    experts as a loop over them in PyTorch; "fastlm" and "auto" run the grouped kernels in eager
    mode and under torch.compile alike (Inductor has nothing of its own to fuse them into)."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        experts_per_token: int,
        expert_d_ff: int,
        shared_experts: int = 0,
        kernel: str = "fastlm",
    ) -> None:
        super().__init__()
        self.kernel = check_kernel(kernel)
        self.experts_per_token = experts_per_token
        # the experts' weights are drawn first, as `fastlm.model.materialize` visits this module
        # before its children: the same values either way
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * expert_d_ff, d_model))
        self.down = nn.Parameter(torch.empty(num_experts, d_model, expert_d_ff))
        self.reset_parameters()
        self.router = Linear(d_model, num_experts)
        self.shared = SwiGLUMLP(d_model, shared_experts * expert_d_ff, kernel) if shared_experts else None

    def reset_parameters(self) -> None:
        experts, d_model, width = self.down.shape
        std = math.sqrt(2.0 / (d_model + width))  # Linear's, for (width, d) and (d, width) alike
        for weight in (self.gate_up, self.down):
            trunc_normal_(weight, std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStatistics]:
        tokens = x.reshape(-1, x.shape[-1])  # (T, d)
        logits = self.router(tokens)  # (T, E)
        weights, index = route(logits, self.experts_per_token, "softmax_topk", normalize=True)
        out = experts_output(tokens, self.gate_up, self.down, index, weights, "silu", fused=self.kernel != "torch")
        out = out.reshape(x.shape)
        if self.shared is not None:
            out = out + self.shared(x)
        experts = self.gate_up.shape[0]
        statistics = RouterStatistics(
            load_balancing_loss(logits, index), router_z_loss(logits), expert_counts(index, experts)
        )
        return out, statistics

    def extra_repr(self) -> str:
        experts, width, d_model = self.gate_up.shape
        return f"experts={experts}, experts_per_token={self.experts_per_token}, expert_d_ff={width // 2}"
