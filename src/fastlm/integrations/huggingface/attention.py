"""The "fastlm" attention implementation of transformers' ``AttentionInterface`` and its mask function.

Plain causal attention runs `fastlm.layers.attention.flash_causal_attention` on the grouped heads as
they are, with the sliding window if the model has one, packed sequences (cu_seq_lens_q/k) through
the varlen kernels, right- or left-padded batches (`Padding`) by
`fastlm.layers.attention.unpadded_causal_attention`; every other case (a mask with holes, dropout,
non-causal attention) runs transformers' SDPA function (Gemma 2's eager attention where the
scores are softcapped), with a one-time warning per case.
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import torch

from fastlm.layers.attention import flash_causal_attention, unpadded_causal_attention

ATTN_IMPLEMENTATION = "fastlm"
# keyword the patched base model adds to its layers' calls when it was given no attention mask, or
# one it read as padding (`PADDING`): the attention is causal, within the packed sequences of
# cu_seq_lens_q/k or the rows' real tokens if any, within the sliding window if any
# (`fastlm.integrations.huggingface.forwards.base_model_forward`), so a mask transformers built
# says nothing more
PLAIN_CAUSAL = "fastlm_plain_causal"
# keyword the patched base model adds with PLAIN_CAUSAL when its attention mask is right or left
# padding: the `Padding` of the batch, read from the mask once per forward for every layer
PADDING = "fastlm_padding"


class Padding(NamedTuple):
    """A batch of rows whose real tokens are contiguous (right or left padding), as a 2-D attention
    mask gives it: each row's real tokens attend causally among themselves, padded keys are seen by
    no query (transformers' SDPA mask), padded queries' outputs are 0."""

    mask: torch.Tensor  # (B, N) bool, True at the real tokens: SDPA's mask where SDPA runs
    rows: torch.Tensor  # (T,) int64: the row of each of the T real tokens, row-major
    positions: torch.Tensor  # (T,) int64: its position in the row
    cu_seqlens: torch.Tensor  # (B + 1,) int32: the rows' real lengths cumulated, from 0
    max_seqlen: int  # the longest row's real length


_warned_fallbacks: set[tuple[str, str]] = set()  # (reason, what ran instead)


def attention_function(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs
):
    """The "fastlm" attention implementation, with transformers' attention-function signature:
    query (B, H, Nq, D), key and value (B, Hkv, Nk, D) -> ((B, Nq, H, D), None).

    Causal attention runs `fastlm.flash_attention` on the grouped heads as they are, with the
    sliding window if the model has one; packed sequences (cu_seq_lens_q / cu_seq_lens_k over the
    rows laid end to end, no sequence spanning two rows) and padded batches (`PADDING`: the real
    tokens of each row, one sequence each, 0 at padded queries) run `fastlm.flash_attention_varlen`.
    Every other case runs transformers' SDPA function (softcapped scores, Gemma 2's: the model's
    eager attention, which softcaps), once warned per case (`_fallback_reason`): the result is
    always exact, the kernels are used where they compute the same thing.
    """
    padding = kwargs.pop(PADDING, None)
    softcap = kwargs.pop("softcap", None)  # Gemma 2's attn_logit_softcapping
    if kwargs.pop(PLAIN_CAUSAL, False):
        # a mask transformers built anyway (it always does while torch.compile traces, to look for
        # packed sequences in the position ids) holds nothing the checks below do not see
        attention_mask = None
    reason = _fallback_reason(module, query, key, attention_mask, dropout, kwargs)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _warn_once(reason, "eager" if softcap is not None else "SDPA")
        if attention_mask is None:
            attention_mask = _implicit_mask(query, key, sliding_window, padding, kwargs)
        if softcap is not None:
            causal = _is_causal(module, kwargs)
            return _softcapped_eager(module, query, key, value, attention_mask, dropout, scaling, softcap, causal)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # transformers' window: query i sees key j when i - sliding_window < j <= i, the layer's too
    if padding is not None:
        _, rows, positions, cu_seqlens, max_seqlen = padding
        out = unpadded_causal_attention(
            query,
            key,
            value,
            rows,
            positions,
            cu_seqlens,
            max_seqlen,
            scale=scaling,
            window=sliding_window,
            softcap=softcap,
        )
        return out, None
    out = flash_causal_attention(
        query,
        key,
        value,
        scale=scaling,
        window=sliding_window,
        cu_seqlens_q=kwargs.get("cu_seq_lens_q"),
        cu_seqlens_k=kwargs.get("cu_seq_lens_k"),
        max_seqlen_q=kwargs.get("max_length_q") or 0,
        max_seqlen_k=kwargs.get("max_length_k") or 0,
        softcap=softcap,
    )
    return out, None


def _fallback_reason(module, query, key, attention_mask, dropout, kwargs) -> str | None:
    """Why the kernels cannot compute this call, or None when they can: causal attention over the
    keys, within a sliding window if any, and within the packed sequences of cu_seq_lens_q /
    cu_seq_lens_k if given.

    The mask transformers builds for the "fastlm" implementation (`mask_function`) is None only
    where the attention is plain causal; the patched base model (`base_model_forward`) sets it
    aside where it knows there is no padding, or where it is right or left padding without a cache
    (then `PADDING` says so). Dropout and non-causal attention do not show in it.
    """
    if attention_mask is not None:
        return (
            "an attention mask (padding with holes or with a cache, a 4-D mask, "
            "or packing and windows without the patched base model)"
        )
    packed = kwargs.get("cu_seq_lens_q") is not None
    if packed and kwargs.get("max_length_q") is None:
        return "packed sequences without max_length_q"
    if dropout > 0.0:
        return "attention dropout"
    if not _is_causal(module, kwargs):
        return "non-causal attention"
    if 1 < query.shape[2] < key.shape[2] or (packed and query.shape[2] != key.shape[2]):
        # a static cache's prefill: SDPA aligns the mask top-left
        return "more keys than queries without a mask"
    return None


def _is_causal(module, kwargs) -> bool:
    """Whether the call is causal: its ``is_causal`` keyword, else the module's (True without one)."""
    is_causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if is_causal is None else is_causal


def _softcapped_eager(module, query, key, value, attention_mask, dropout, scaling, softcap, causal: bool):
    """The fallback for softcapped scores, which SDPA does not softcap: the model's own eager
    attention function (Gemma 2's), with the mask SDPA would apply as the additive one it adds to
    the scores. Without a mask, as transformers' SDPA call: where ``causal``, aligned top-left for
    several queries (a static cache's empty slots come last), none for one query (a decoding
    step)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    n_q, n_k = query.shape[2], key.shape[2]
    if attention_mask is None and causal and n_q > 1:
        rows = torch.arange(n_q, device=query.device)[:, None]
        attention_mask = (torch.arange(n_k, device=query.device)[None, :] <= rows)[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        additive = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        attention_mask = additive.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap)


def _warn_once(reason: str, fallback: str = "SDPA") -> None:
    """One warning per reason and process; none while torch.compile traces, which cannot warn."""
    if (reason, fallback) not in _warned_fallbacks and not torch.compiler.is_compiling():
        _warned_fallbacks.add((reason, fallback))
        warnings.warn(
            f"fastlm attention runs transformers' {fallback} attention for {reason}, which "
            f"fastlm.flash_attention does not cover (same result, {fallback}'s speed)",
            stacklevel=3,
        )


def _implicit_mask(query, key, sliding_window, padding, kwargs) -> torch.Tensor | None:
    """The mask of what the call's arguments say but no mask carries, for SDPA: (B or 1, 1, Nq, Nk)
    bool, True where query i (at position i + Nk - Nq) sees key j: j <= i, inside the sliding
    window, in the same packed sequence (cu_seq_lens: the sequences' start offsets over the rows
    laid end to end, and the total), not a padded key (``padding``: the mask transformers builds
    from the 2-D one). None when neither packing, padding nor a window applies: SDPA's own
    arguments cover the other cases."""
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    windowed = sliding_window is not None and key.shape[2] > sliding_window
    if cu_seq_lens_q is None and padding is None and not windowed:
        return None
    n_q, n_k = query.shape[2], key.shape[2]
    rows = torch.arange(n_k - n_q, n_k, device=query.device)[:, None]
    cols = torch.arange(n_k, device=key.device)[None, :]
    visible = cols <= rows
    if windowed:
        visible &= cols > rows - sliding_window
    if padding is not None:
        visible = visible & padding.mask[:, None, :]  # (B, Nq, Nk)
    if cu_seq_lens_q is None:
        return visible.view(-1, 1, n_q, n_k)
    first_row = torch.arange(query.shape[0], device=query.device)[:, None, None]  # each row's offset, in rows
    sequence_q = torch.searchsorted(
        cu_seq_lens_q[1:].long(), (first_row * n_q + rows - (n_k - n_q)).flatten(1), right=True
    )
    sequence_k = torch.searchsorted(cu_seq_lens_k[1:].long(), (first_row * n_k + cols).flatten(1), right=True)
    same = sequence_q.view(-1, n_q, 1) == sequence_k.view(-1, 1, n_k)  # (B, Nq, Nk)
    return (visible & same)[:, None]


def mask_function(*args, **kwargs):
    """The "fastlm" entry of transformers' AttentionMaskInterface: SDPA's mask, or None where that
    is plain causal attention over all keys. transformers returns None there itself, except where it
    builds the mask to look for packed sequences and keeps it (transformers 4, and 5 while
    torch.compile traces). The comparison reads the mask, so tracing keeps it: SDPA then runs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    if mask is None or torch.compiler.is_compiling() or mask.shape[-1] != mask.shape[-2]:
        return mask
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return None if torch.equal(mask, causal.expand_as(mask)) else mask


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_function)
    # transformers builds an implementation's mask with the function registered under its name; one
    # with no entry gets no mask at all, padding and packing included
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)
