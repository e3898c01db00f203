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

from fastlm.ops.common import check_dtype, check_integer, check_number, check_same_device, check_tensor
from fastlm.ops.linear_cross_entropy import LossOptions, compute_hidden, linear_cross_entropy
from fastlm.ops.linear_pair_loss import LinearPairLossFunction, pair_rows_limit

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


def _check_dpo_options(beta, label_smoothing, loss_type: str) -> tuple[float, float]:
    """(beta, label_smoothing) checked against the loss type (see `dpo_loss`)."""
    beta = check_number("beta", beta, positive=True)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    label_smoothing = check_number("label_smoothing", label_smoothing, 0.0, 0.5)
    if loss_type in ("hinge", "ipo") and label_smoothing:
        raise ValueError(f"loss_type {loss_type} takes no label_smoothing, got {label_smoothing}")
    if loss_type == "robust" and label_smoothing == 0.5:
        raise ValueError("label_smoothing must be below 0.5 for loss_type robust (it divides by 1 - 2 eps)")
    return beta, label_smoothing


def _dpo_pair_losses(h: torch.Tensor, beta: float, eps: float, loss_type: str) -> torch.Tensor:
    """Per-pair DPO losses (B,) of h = log-ratio(chosen) - log-ratio(rejected), as `dpo_loss` lists them."""
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return F.relu(1 - beta * h)
    return (h - 1 / (2 * beta)).square()


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
    beta, label_smoothing = _check_dpo_options(beta, label_smoothing, loss_type)
    chosen_ratio = _float(policy_chosen_logps) - _float(ref_chosen_logps).detach()  # log pi / pi_ref
    rejected_ratio = _float(policy_rejected_logps) - _float(ref_rejected_logps).detach()
    losses = _dpo_pair_losses(chosen_ratio - rejected_ratio, beta, label_smoothing, loss_type)
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


def _selected_targets(hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """targets (B, T), _IGNORED where ``mask`` (B, T) bool is False (None: all True), after
    checking the shapes of hidden (B, T, d), targets and mask."""
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
        return targets
    check_tensor("mask", mask)
    check_dtype("mask", mask, (torch.bool,))
    if mask.shape != targets.shape:
        raise ValueError(f"mask must have shape {tuple(targets.shape)} to match targets, got {tuple(mask.shape)}")
    check_same_device(targets=targets, mask=mask)
    return targets.masked_fill(~mask, _IGNORED)


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
    selected = _selected_targets(hidden, targets, mask)
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
    tokens = torch.full_like(total, targets.shape[1], dtype=torch.long) if mask is None else mask.sum(1)
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
    loss_type as in `dpo_loss`.

    With gradients, no bias and outside ``torch.compile``, the loss and every gradient come from
    one pass over groups of whole pairs (`fastlm.ops.linear_pair_loss`: 6 N V d FLOPs, not the 8
    of the log-probabilities' own backward) whenever one pair's 2T rows fit ``chunk_rows`` (by
    default four default chunks: 8192 rows at V = 128256 on an H100); the memory is then the
    logits of a group of pairs, (2kT, V) in the compute dtype."""
    check_tensor("hidden", hidden)
    if hidden.dim() != 3 or hidden.shape[0] % 2:
        raise ValueError(f"hidden must be (2B, T, d), chosen rows then rejected rows, got {tuple(hidden.shape)}")
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    pairs, length = hidden.shape[0] // 2, hidden.shape[1]
    if grads and bias is None and pairs and length and not torch.compiler.is_compiling():
        if chunk_rows is not None:
            chunk_rows = check_integer("chunk_rows", chunk_rows, minimum=1)
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        if 2 * length <= pair_rows_limit(hidden.device, dtype, weight.shape[0], chunk_rows):
            selected = _selected_targets(hidden, targets, mask)
            compute = compute_hidden(hidden.flatten(0, 1), weight, selected.flatten(), None, _IGNORED)
            tokens = torch.full_like(selected[:, 0], length) if mask is None else mask.sum(1)
            return _fused_dpo(
                compute.view(hidden.shape),
                weight,
                selected,
                tokens,
                ref_chosen_logps,
                ref_rejected_logps,
                beta,
                label_smoothing,
                loss_type,
                average_logps,
                chunk_rows,
            )
    logps = sequence_logprobs(hidden, weight, targets, mask, bias, chunk_rows=chunk_rows)
    policy = logps.mean if average_logps else logps.sum
    chosen, rejected = policy.chunk(2)
    return dpo_loss(chosen, rejected, ref_chosen_logps, ref_rejected_logps, beta, label_smoothing, loss_type)


def _fused_dpo(
    hidden,
    weight,
    targets,
    tokens,
    ref_chosen_logps,
    ref_rejected_logps,
    beta,
    label_smoothing,
    loss_type,
    average,
    chunk_rows,
) -> DPOOutput:
    """`linear_dpo_loss` by `LinearPairLossFunction`, hidden already in the compute dtype, targets
    already masked, tokens (2B,) each sequence's count as `sequence_logprobs` gives it."""
    pairs = hidden.shape[0] // 2
    for name, ref in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        _check_rewards(name, ref, 1)
        if ref.shape != (pairs,):
            raise ValueError(f"{name} must have shape ({pairs},), one per pair, got {tuple(ref.shape)}")
    check_same_device(hidden=hidden, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    beta, label_smoothing = _check_dpo_options(beta, label_smoothing, loss_type)
    ref_chosen, ref_rejected = _float(ref_chosen_logps).detach(), _float(ref_rejected_logps).detach()

    def pair_losses(chosen, rejected, rows: slice):
        h = (chosen - ref_chosen[rows]) - (rejected - ref_rejected[rows])
        return _dpo_pair_losses(h, beta, label_smoothing, loss_type)

    options = LossOptions(_IGNORED, 0.0, 0.0, None)
    loss, logps = LinearPairLossFunction.apply(
        hidden, weight, targets, tokens, pair_losses, average, options, chunk_rows
    )
    chosen, rejected = logps.chunk(2)
    return DPOOutput(loss, beta * (chosen - ref_chosen), beta * (rejected - ref_rejected))
