"""Packed variable-length sequences: `flash_attention_varlen` and its reference.

Documents laid end to end along one token axis, q (total_q, H, D) and k, v (total_k, Hkv, D), and
delimited by int32 cumulative lengths (documents + 1,): document d's queries are rows
cu_seqlens_q[d] to cu_seqlens_q[d + 1] - 1, and they see only the keys of rows cu_seqlens_k[d] to
cu_seqlens_k[d + 1] - 1. This is FlashAttention's ``flash_attn_varlen_func`` interface, and what
Hugging Face's padding-free collator (``DataCollatorWithFlattening``) passes as ``cu_seq_lens``.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from fastlm.ops.common import DTYPES, check_flag, check_integer, check_tensor
from fastlm.ops.flash_attention.api import attend, check_head_device_dtype, default_scale, flash_attention_ref
from fastlm.ops.flash_attention.masks import check_window


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
) -> tuple[int, int]:
    """One clear error for each way packed inputs can be wrong; returns (max_seqlen_q, max_seqlen_k)
    as ints. The values of the cumulative lengths are not read (that would wait for the GPU)."""
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, tensor)
    if q.dim() != 3:
        raise ValueError(f"q must be packed as (total_q, H, D), got shape {tuple(q.shape)}")
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must be packed as (total_k, Hkv, D) of one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    check_head_device_dtype(q, k, v, True, dtypes)
    for name, cu_seqlens in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(
                f"{name} must be int32 cumulative lengths, got {str(cu_seqlens.dtype).removeprefix('torch.')}"
            )
        if cu_seqlens.dim() != 1 or len(cu_seqlens) == 0 or not cu_seqlens.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D tensor of documents + 1 cumulative lengths, got "
                f"shape {tuple(cu_seqlens.shape)} and strides {cu_seqlens.stride()}"
            )
        if cu_seqlens.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu_seqlens.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must list the same documents, got "
            f"{len(cu_seqlens_q)} and {len(cu_seqlens_k)} entries"
        )
    return check_integer("max_seqlen_q", max_seqlen_q, minimum=0), check_integer(
        "max_seqlen_k", max_seqlen_k, minimum=0
    )


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention within each of a batch of packed documents, without materializing the scores.

    Args:
        q: (total_q, H, D), the documents' queries end to end.
        k, v: (total_k, Hkv, D); H must be a multiple of Hkv (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: int32 (documents + 1,) on q's device, rising from 0 to total_q
            (total_k); equal for self-attention over packed documents. Documents may be empty.
            Not checked (reading them would wait for the GPU): malformed lengths give undefined
            results, as in FlashAttention.
        max_seqlen_q, max_seqlen_k: the longest document's lengths (ints >= 0, as FlashAttention
            takes them); ``max_seqlen_k`` picks the kernels' tiles. The grid does not depend on them.
        causal, scale, window: as in ``flash_attention``, inside each document: query i of a
            document of Mq queries and Mk keys sits at position i + (Mk - Mq) (the ends aligned).

    Returns (total_q, H, D) in q's dtype; queries that see no key (an empty key document, or a
    mask that hides every key) return 0.
    """
    _, max_seqlen_k = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attend(
        q,
        k,
        v,
        check_flag("causal", causal),
        default_scale(q.shape[-1], scale),
        check_window(window),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_k,
    )


def _boundaries(name: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> list[int]:
    """The cumulative lengths as a list, checked: from 0 to ``total``, never falling, no document
    longer than ``max_seqlen``."""
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != total or min(lengths, default=0) < 0:
        raise ValueError(f"{name} must rise from 0 to {total} without falling, got {bounds}")
    if max(lengths, default=0) > max_seqlen:
        raise ValueError(f"{name} holds a document of {max(lengths)} rows, longer than max_seqlen ({max_seqlen})")
    return bounds


def flash_attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``flash_attention_varlen``'s semantics by ``flash_attention_ref`` on each document in turn, in
    fp32 (fp64 stays fp64); checks the cumulative lengths too. Returns q's dtype promoted to at least fp32."""
    max_seqlen_q, max_seqlen_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=(*DTYPES, torch.float64)
    )
    bounds_q = _boundaries("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    bounds_k = _boundaries("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)

    def document(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return t[start:end].transpose(0, 1).unsqueeze(0)  # (1, heads, length, D)

    outputs = [
        flash_attention_ref(
            document(q, q0, q1), document(k, k0, k1), document(v, k0, k1), causal=causal, scale=scale, window=window
        )[0].transpose(0, 1)
        for (q0, q1), (k0, k1) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True)
    ]
    return torch.cat(outputs) if outputs else q.to(torch.promote_types(q.dtype, torch.float32))
