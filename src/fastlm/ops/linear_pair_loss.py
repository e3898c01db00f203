"""A loss over preference pairs from the LM's last hidden states, forward and backward in one pass.

A pair loss (DPO and its kin) is a mean over B pairs of a cheap function of two numbers per pair,
the sequence log-probabilities c_b and r_b of the chosen and the rejected response:

    loss = (1 / B) sum_b f_b(c_b, r_b)        c_b = sum_t m_bt log p(y_bt)   (or its mean over t)

Its gradient reaches token t of sequence s only through that sequence's log-probability:
d loss / d logits_st = -(d loss / d logp_s) m_st (softmax_st - onehot(y_st)) = s_st G_st, with
G = d(-log p) / d logits what the fused cross-entropy kernel writes. Since s is known only once
every token of the pair is seen, the tokens are processed in groups of whole pairs: per group of
k pairs (2 k T rows, its chosen rows then its rejected rows),

    logits_g = hidden_g @ W.T                                cuBLAS                2 (2kT) V d FLOPs
    losses, G = fused cross-entropy kernel, G over logits_g in place
    c, r      = per-sequence sums of -losses;  s = -d loss / d (c, r) by autograd on (k,) tensors
    grad_hidden_g = s * (G @ W)                              cuBLAS, then (2kT, d) scaled
    grad_weight  += G.T @ (s * hidden_g)                     cuBLAS into W's dtype

6 N V d FLOPs in all, where `sequence_logprobs` followed by the loss needs 8 (its backward
recomputes the logits, the per-token upstream gradients being unknown in its forward). The price
is memory: a group's logits, (2kT, V) in the compute dtype, at least one whole pair.
`linear_dpo_loss` picks this path when one pair fits (`pair_rows_limit`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastlm.ops.common import device_arch
from fastlm.ops.cross_entropy.launchers import _scale_rows
from fastlm.ops.linear_cross_entropy import (
    LossOptions,
    _chunk_dlogits,
    _matmul_into,
    _scale_gradients,
    linear_cross_entropy_config,
)

# (chosen_logps, rejected_logps, pairs) -> per-pair losses (k,): the pair loss f_b of the pairs
# ``pairs`` (a slice of range(B)) from their sequence log-probabilities (k,) fp32.
PairLosses = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]

PAIR_CHUNKS = 4  # a group may hold up to this many of linear_cross_entropy's default chunks


def _default_chunk_rows(device: torch.device, dtype: torch.dtype, vocab: int) -> int:
    return linear_cross_entropy_config(device_arch(device), dtype, vocab).chunk_rows


def pair_rows_limit(device: torch.device, dtype: torch.dtype, vocab: int, chunk_rows: int | None) -> int:
    """Rows (tokens) a group of pairs computed in ``dtype`` may hold: ``chunk_rows`` if given, else
    PAIR_CHUNKS times `linear_cross_entropy_config`'s chunk (2 GiB of bf16 logits on an H100: 8192
    rows at V = 128256, one pair of 4096-token responses)."""
    return PAIR_CHUNKS * _default_chunk_rows(device, dtype, vocab) if chunk_rows is None else chunk_rows


def _group_pairs(hidden: torch.Tensor, vocab: int, chunk_rows: int | None) -> int:
    """Pairs per group: as many whole pairs as fit one default chunk (or ``chunk_rows``), at least
    one (hidden (2B, T, d) with T >= 1)."""
    rows = _default_chunk_rows(hidden.device, hidden.dtype, vocab) if chunk_rows is None else chunk_rows
    return max(1, rows // (2 * hidden.shape[1]))


def _pair_rows(tensor: torch.Tensor, pairs: slice, rejected: slice) -> torch.Tensor:
    """The chosen rows ``pairs`` and their rejected rows of a (2B, T, ...) tensor, as one
    (2k T, ...) tensor (a copy)."""
    return torch.cat((tensor[pairs], tensor[rejected])).flatten(0, 1)


class LinearPairLossFunction(torch.autograd.Function):
    """``apply(hidden, weight, targets, tokens, pair_losses, average, options, chunk_rows)`` ->
    (loss, logps): the mean pair loss (0-d fp32) and the policy's sequence log-probabilities (2B,)
    fp32 (non-differentiable). hidden (2B, T, d) and targets (2B, T) as `sequence_logprobs` takes
    them, B >= 1 pairs and T >= 1, chosen rows first, targets already ``options.ignore_index`` where
    the mask is False; tokens (2B,) the count each sequence's mean divides by (``average``: the
    per-token mean instead of the sum). Every gradient is computed in the forward; backward scales
    them by the upstream gradient."""

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, tokens, pair_losses: PairLosses, average: bool, options: LossOptions, chunk_rows
    ):
        count, length = hidden.shape[0] // 2, hidden.shape[1]
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else None
        logps = torch.empty(2 * count, device=hidden.device, dtype=torch.float32)
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        group = _group_pairs(hidden, weight.shape[0], chunk_rows)
        compute_weight = weight.to(hidden.dtype)
        for start in range(0, count, group):
            pairs = slice(start, min(start + group, count))
            rejected = slice(count + pairs.start, count + pairs.stop)  # their rejected rows
            k = pairs.stop - pairs.start
            rows_hidden = _pair_rows(hidden, pairs, rejected)  # (2kT, d)
            rows_targets = _pair_rows(targets, pairs, rejected)
            losses, dlogits = _chunk_dlogits(
                rows_hidden, compute_weight, None, compute_weight.shape[0], rows_targets, None, options, False
            )
            counts = torch.cat((tokens[pairs], tokens[rejected])).clamp(min=1)
            sums = -losses.view(2 * k, length).sum(1)
            seq = sums / counts if average else sums
            with torch.enable_grad():
                chosen_logps, rejected_logps = (x.detach().requires_grad_() for x in seq.chunk(2))
                group_loss = pair_losses(chosen_logps, rejected_logps, pairs).sum() / count
                grad_seq = torch.cat(torch.autograd.grad(group_loss, (chosen_logps, rejected_logps)))  # (2k,)
            loss += group_loss.detach()
            logps[pairs] = seq[:k]
            logps[rejected] = seq[k:]
            # d loss / d losses_t = -d loss / d seq (/ tokens): the same factor for a sequence's rows
            scale = -grad_seq / counts if average else -grad_seq
            row_scale = scale.repeat_interleave(length)[:, None]  # (2kT, 1) fp32
            # the (2kT, d) factors are scaled in fp32 and rounded once; 1/V of the logits' memory
            if need_hidden:
                product = torch.empty(rows_hidden.shape, device=hidden.device, dtype=torch.float32)
                _matmul_into(product, dlogits, compute_weight, False, traced=False)
                grad_rows = product.mul_(row_scale).view(2 * k, length, -1)
                grad_hidden[pairs] = grad_rows[:k]
                grad_hidden[rejected] = grad_rows[k:]
                del product, grad_rows
            if need_weight:
                _matmul_into(grad_weight, dlogits.t(), rows_hidden.mul_(row_scale), start > 0, traced=False)
            del dlogits  # before the next group's logits are allocated
        ctx.grads = (grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logps)
        return loss, logps

    @staticmethod
    def backward(ctx, grad_loss, _grad_logps):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("linear_dpo_loss's backward can run only once per forward")
        _scale_gradients(grads, grad_loss, _scale_rows)  # free on the GPU where it is 1
        return *grads, *(None,) * 6
