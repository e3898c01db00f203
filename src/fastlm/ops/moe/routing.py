"""The routers' choice of experts: router logits (T, E) -> routing weights and experts (T, K).

    "softmax_topk"  softmax over the E experts, then the K largest (Mixtral, Qwen2/3-MoE, OLMoE)
    "topk_softmax"  the K largest logits, then softmax over those K (GPT-OSS)
    "sigmoid_bias"  sigmoid scores; the experts picked by score + bias (a balancing bias that
                    moves only the choice), weighted by their scores (DeepSeek-V3, without its
                    expert groups)
``normalize`` rescales each token's K weights to sum to 1 (the families' norm_topk_prob), after
which ``scale`` multiplies them. The scores are computed in fp32 whatever the logits' dtype, as the
families do, and ties go to the lower expert index, as torch.topk breaks them. These are PyTorch
ops on a (T, E) tensor, a small fraction of the experts' time; torch.compile fuses them.
"""

from __future__ import annotations

import torch

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_bias")


def route(
    logits: torch.Tensor,
    k: int,
    routing: str = "softmax_topk",
    normalize: bool = False,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_weights (T, K) fp32, top_k_index (T, K) int64) for router ``logits`` (T, E) by
    ``routing`` (module docstring); ``bias`` (E,) only for "sigmoid_bias". Differentiable in the
    logits through the weights."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if logits.dim() != 2:
        raise ValueError(f"expected router logits (T, E), got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in [1, {experts}] for {experts} experts, got {k}")
    if (bias is not None) != (routing == "sigmoid_bias"):
        raise ValueError(f"a bias goes with routing 'sigmoid_bias' only, got routing {routing!r}")
    if bias is not None and bias.shape != (experts,):
        raise ValueError(f"bias must be ({experts},), got shape {tuple(bias.shape)}")
    scores = logits.float()
    if routing == "softmax_topk":
        weights, index = torch.topk(scores.softmax(dim=-1), k, dim=-1)
    elif routing == "topk_softmax":
        top, index = torch.topk(scores, k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        scores = scores.sigmoid()
        index = torch.topk(scores + bias.float(), k, dim=-1).indices
        weights = scores.gather(1, index)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return weights * scale if scale != 1.0 else weights, index
