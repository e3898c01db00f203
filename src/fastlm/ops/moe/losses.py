"""The routers' auxiliary losses, from one layer's router logits (T, E) and its choice (T, K):

    load_balancing_loss = E * sum_e f_e * P_e        (Switch Transformer, eqs. 4-6)
        f_e = the pairs routed to expert e / T       (sums to K over the experts)
        P_e = mean over the tokens of softmax(logits)[:, e]
      K when the tokens spread evenly over the experts, up to K E when all go to one; only P_e
      carries a gradient (f_e counts a choice). transformers' `load_balancing_loss_func` of
      Mixtral and Qwen3-MoE for one layer, without an attention mask.
    router_z_loss = mean over the tokens of logsumexp(logits)^2   (ST-MoE, eq. 5)
      keeps the logits small, where bf16 rounds them least.

Both in fp32 whatever the logits' dtype, PyTorch ops on (T, E) tensors; the counts by a scatter of
the T K choices, with no host synchronization.
"""

from __future__ import annotations

import torch


def expert_counts(top_k_index: torch.Tensor, experts: int) -> torch.Tensor:
    """(E,) int64: how many of the (T, K) choices picked each expert (a choice outside [0, E)
    counts nowhere)."""
    index = top_k_index.reshape(-1)
    inside = (index >= 0) & (index < experts)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=index.device)
    counts.scatter_add_(0, torch.where(inside, index, experts), torch.ones_like(index, dtype=torch.int64))
    return counts[:experts]


def load_balancing_loss(logits: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer load-balancing loss of router ``logits`` (T, E) that chose
    ``top_k_index`` (T, K): a 0-dim fp32 tensor (module docstring)."""
    _check(logits)
    if top_k_index.dim() != 2 or top_k_index.shape[0] != logits.shape[0]:
        raise ValueError(
            f"top_k_index must be (T, K) with T = {logits.shape[0]} (the logits' rows), got {tuple(top_k_index.shape)}"
        )
    tokens, experts = logits.shape
    fraction = expert_counts(top_k_index, experts).float() / tokens  # f_e
    probability = logits.float().softmax(dim=-1).mean(dim=0)  # P_e
    return experts * (fraction * probability).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The ST-MoE router z-loss of ``logits`` (T, E): mean of logsumexp(logits)^2, 0-dim fp32."""
    _check(logits)
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"expected router logits (T, E) with T > 0, got shape {tuple(logits.shape)}")
