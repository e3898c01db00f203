"""Preference and ranking losses, and the sequence log-probabilities they need.

    bradley_terry_loss   mean_b  -log sigmoid(r_chosen - r_rejected - margin)          (reward models)
    ranking_loss         the same over the K(K-1)/2 pairs a ranking of K responses implies
    dpo_loss             DPO on sequence log-probabilities: sigmoid, ipo, hinge, robust (TRL's loss types)
    sequence_logprobs    sum_t log p(target_t) per sequence, through `fastlm.linear_cross_entropy`:
                         the (tokens, V) logits are never held
    linear_dpo_loss      DPO from the policy's last hidden states: chosen and rejected rows in one
                         `linear_cross_entropy` call, then `dpo_loss`

Every loss is a function of differences of rewards (or log-probability ratios), computed with
log-sigmoid (``F.logsigmoid``, stable for any sign and magnitude), never log(sigmoid(.)), in fp32
(float64 inputs stay float64). Formulas and limits: docs/losses.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastlm.ops.common import check_dtype, check_number, check_same_device, check_tensor
from fastlm.ops.linear_cross_entropy import linear_cross_entropy

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
_REWARD_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_IGNORED = -100  # the target `sequence_logprobs` gives linear_cross_entropy at masked positions


def _float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or float64 if it is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check_rewards(name: str, tensor, dims: int) -> None:
    check_tensor(name, tensor)
    check_dtype(name, tensor, _REWARD_DTYPES)
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")


def _check_same_shape_and_device(**tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors.values()}
    if len(shapes) > 1:
        listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())
        raise ValueError(f"expected tensors of one shape, got {listed}")
    check_same_device(**tensors)


# ----------------------------------------------------------------------------------------------
# Reward-model losses
# ----------------------------------------------------------------------------------------------


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Bradley-Terry loss of a reward model: mean over b of -log sigmoid(chosen_b - rejected_b - margin_b).

    chosen, rejected (B,) rewards of the preferred and the other response to one prompt; margin a
    number or a (B,) tensor (Llama 2's preference-strength margin). Returns a scalar in fp32
    (float64 for float64 rewards); an empty batch gives NaN, as a mean over nothing."""
    _check_rewards("chosen", chosen, 1)
    _check_rewards("rejected", rejected, 1)
    _check_same_shape_and_device(chosen=chosen, rejected=rejected)
    if isinstance(margin, torch.Tensor):
        _check_rewards("margin", margin, 1)
        _check_same_shape_and_device(chosen=chosen, margin=margin)
        margin = _float(margin)
    else:
        margin = check_number("margin", margin)
    return -F.logsigmoid(_float(chosen) - _float(rejected) - margin).mean()


def ranking_loss(rewards: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """K-way ranking loss: the Bradley-Terry loss averaged over the pairs a ranking implies.

    rewards (B, K), each row ordered from the most to the least preferred response; mask (B, K)
    bool, False at padding columns (default: all True). Per row, the mean of
    -log sigmoid(r_i - r_j) over the pairs i < j of unmasked columns (K(K-1)/2 of them when none
    is masked), then the mean over the rows that have at least one pair; 0 when none has.
    Returns a scalar in fp32 (float64 for float64 rewards)."""
    _check_rewards("rewards", rewards, 2)
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)
    check_tensor("mask", mask)
    check_dtype("mask", mask, (torch.bool,))
    _check_same_shape_and_device(rewards=rewards, mask=mask)
    r = _float(rewards).masked_fill(~mask, 0.0)  # padding that is not finite would reach the gradients
    k = r.shape[1]
    before = torch.ones(k, k, dtype=torch.bool, device=r.device).triu(1)  # (K, K): i ranked above j
    pairs = before & mask[:, :, None] & mask[:, None, :]  # (B, K, K)
    losses = -F.logsigmoid(r[:, :, None] - r[:, None, :])  # (B, K, K)
    pair_counts = pairs.sum((1, 2))  # (B,)
    row_losses = torch.where(pairs, losses, 0.0).sum((1, 2)) / pair_counts.clamp(min=1)
    return row_losses.sum() / (pair_counts > 0).sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------


class DPOOutput(NamedTuple):
    """`dpo_loss`'s result: the mean loss, and the implicit rewards beta * (log pi - log pi_ref) of
    the chosen and the rejected responses (B,), detached, as trainers log them."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> DPOOutput:
    """Direct Preference Optimization (Rafailov et al., 2023) on sequence log-probabilities (B,).

    With h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected) and eps =
    label_smoothing, per pair (the loss types of TRL's DPOTrainer):

        sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     (cDPO when eps > 0)
        robust   (-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)  (rDPO)
        hinge    max(0, 1 - beta h)                                            (SLiC)
        ipo      (h - 1 / (2 beta))^2                                          (IPO)

    and the loss is their mean over the batch. beta > 0; label_smoothing in [0, 0.5] for sigmoid,
    [0, 0.5) for robust, 0 for hinge and ipo. Gradients flow to the policy log-probabilities; the
    reference ones are treated as constants whether or not they require grad."""
    logps = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
    }
    for name, tensor in logps.items():
        _check_rewards(name, tensor, 1)
    _check_same_shape_and_device(**logps)
    beta = check_number("beta", beta, positive=True)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if loss_type in ("hinge", "ipo"):
        label_smoothing = check_number("label_smoothing", label_smoothing, 0.0, 0.0)
    else:
        label_smoothing = check_number("label_smoothing", label_smoothing, 0.0, 0.5)
        if loss_type == "robust" and label_smoothing == 0.5:
            raise ValueError("label_smoothing must be below 0.5 for loss_type robust (it divides by 1 - 2 eps)")
    chosen_ratio = _float(policy_chosen_logps) - _float(ref_chosen_logps).detach()  # log pi / pi_ref
    rejected_ratio = _float(policy_rejected_logps) - _float(ref_rejected_logps).detach()
    h = chosen_ratio - rejected_ratio  # (B,)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = F.relu(1 - beta * h)
    else:
        losses = (h - 1 / (2 * beta)).square()
    return DPOOutput(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


# ----------------------------------------------------------------------------------------------
# Sequence log-probabilities without the logits
# ----------------------------------------------------------------------------------------------


class SequenceLogprobs(NamedTuple):
    """`sequence_logprobs`'s result, each (B,) fp32: the sum of the selected tokens'
    log-probabilities, their mean (0 for a sequence with no selected token), and their number."""

    sum: torch.Tensor
    mean: torch.Tensor
    tokens: torch.Tensor


def sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    chunk_rows: int | None = None,
) -> SequenceLogprobs:
    """Per-sequence sums and means of log p(targets) under the logits ``hidden @ weight.T + bias``,
    without holding the (B T, V) logits.

    hidden (B, T, d) the LM's last hidden states, weight (V, d) its LM head, bias (V,) or None,
    targets (B, T) the token each position predicts (already shifted: position t's target is the
    sequence's token t + 1), mask (B, T) bool, True at the tokens to count (a response's tokens;
    default all). Targets under a False mask are never read, so padding may hold any value.

    The token log-probabilities are -`fastlm.linear_cross_entropy`(..., reduction="none"), so the
    dtypes, autocast behaviour and chunking (``chunk_rows``) are those of that function, and
    gradients reach hidden, weight and bias; the backward recomputes each chunk's logits."""
    check_tensor("hidden", hidden)
    check_tensor("targets", targets)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be 3-D (batch, length, d), got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"targets must have shape {tuple(hidden.shape[:2])} to match hidden "
            f"{tuple(hidden.shape)}, got {tuple(targets.shape)}"
        )
    if mask is None:
        mask = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
    check_tensor("mask", mask)
    check_dtype("mask", mask, (torch.bool,))
    if mask.shape != targets.shape:
        raise ValueError(f"mask must have shape {tuple(targets.shape)} to match targets, got {tuple(mask.shape)}")
    check_same_device(targets=targets, mask=mask)
    selected = targets.masked_fill(~mask, _IGNORED)
    losses = linear_cross_entropy(
        hidden.flatten(0, 1),
        weight,
        selected.flatten(),
        bias,
        ignore_index=_IGNORED,
        reduction="none",
        chunk_rows=chunk_rows,
    )
    total = -losses.view(targets.shape).sum(1)  # (B,): ignored tokens' losses are 0
    tokens = mask.sum(1)
    return SequenceLogprobs(total, total / tokens.clamp(min=1), tokens)


def linear_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    average_logps: bool = False,
    chunk_rows: int | None = None,
) -> DPOOutput:
    """DPO from the policy's last hidden states: `sequence_logprobs` of the chosen and the rejected
    responses in one call, then `dpo_loss`.

    hidden (2B, T, d), targets and mask (2B, T): rows [0, B) the chosen responses, rows [B, 2B) the
    rejected ones (one padded batch, as a policy forward over both makes); ref_chosen_logps and
    ref_rejected_logps (B,) the reference model's sequence log-probabilities, computed beforehand
    (with `sequence_logprobs` under ``torch.no_grad()``, or stored). ``average_logps`` uses the
    per-token mean instead of the sum (IPO's length normalization). beta, label_smoothing and
    loss_type as in `dpo_loss`."""
    check_tensor("hidden", hidden)
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(f"hidden must be (2B, T, d), chosen rows then rejected rows, got {tuple(hidden.shape)}")
    logps = sequence_logprobs(hidden, weight, targets, mask, bias, chunk_rows=chunk_rows)
    policy = logps.mean if average_logps else logps.sum
    chosen, rejected = policy.chunk(2)
    return dpo_loss(chosen, rejected, ref_chosen_logps, ref_rejected_logps, beta, label_smoothing, loss_type)
