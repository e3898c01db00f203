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

from fastlm.ops.common import DTYPES, check_flag, check_integer, check_tensor, is_traced
from fastlm.ops.flash_attention.api import (
    attend,
    check_head_device_dtype,
    check_softcap,
    default_scale,
    flash_attention_ref,
)
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
    as ints. The values of the cumulative lengths are not read here (that would wait for the GPU):
    `check_cu_seqlens` reads them."""
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


def _summary(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(4,) int64: the first and last cumulative length, the shortest and the longest document
    (lengths taken with a 0 among them, so that no documents reads as none shorter than 0)."""
    bounds = cu_seqlens.long()  # int64 differences: int32 ones could wrap around
    lengths = torch.cat((bounds[1:] - bounds[:-1], bounds.new_zeros(1)))
    return torch.stack((bounds[0], bounds[-1], lengths.min(), lengths.max()))


def check_cu_seqlens(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> None:
    """Raise ``ValueError`` naming the argument unless each of the cumulative lengths (checked by
    `check_varlen_inputs`) starts at 0, never falls, and ends at exactly its side's rows (``total_q``
    for cu_seqlens_q, ``total_k`` for cu_seqlens_k), and no document is longer than its side's max_seqlen.

    These are the bounds the kernels rely on without checking them: a last length past the rows
    reads and writes past the tensors, one below them leaves rows past it unwritten, a falling
    one gives a document of negative length, a max_seqlen below the longest document picks tiles
    for shorter documents than there are. Reads the values: free for CPU tensors, one device
    sync (one read of both) for CUDA tensors. A few small tensor operations, no loop over the
    documents; an error's message locates the fault.
    """
    sides = [("cu_seqlens_q", "q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q)]
    if cu_seqlens_k is not cu_seqlens_q or total_k != total_q or max_seqlen_k != max_seqlen_q:
        sides.append(("cu_seqlens_k", "k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k))
    summaries = torch.stack([_summary(side[2]) for side in sides]).tolist()  # the one read
    for (name, rows, cu_seqlens, total, max_name, max_seqlen), (first, last, shortest, longest) in zip(
        sides, summaries, strict=True
    ):
        rule = f"{name} must rise from 0 to {total} ({rows}'s rows) without falling"
        if first != 0:
            raise ValueError(f"{rule}, but it starts at {first}")
        if shortest < 0:
            entry = int(torch.nonzero(cu_seqlens[1:] < cu_seqlens[:-1])[0]) + 1
            fall = f"from {int(cu_seqlens[entry - 1])} to {int(cu_seqlens[entry])} at entry {entry}"
            raise ValueError(f"{rule}, but it falls {fall}")
        if last != total:
            past = f"past {rows}'s last row" if last > total else f"leaving rows {last} to {total - 1} in no document"
            raise ValueError(f"{rule}, but it ends at {last}, {past}")
        if longest > max_seqlen:
            raise ValueError(
                f"{max_name} ({max_seqlen}) must be at least the longest document's length, got a "
                f"document of {longest} rows in {name}"
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
    softcap: float | None = None,
    check: bool = False,
) -> torch.Tensor:
    """Attention within each of a batch of packed documents, without materializing the scores.

    Args:
        q: (total_q, H, D), the documents' queries end to end.
        k, v: (total_k, Hkv, D); H must be a multiple of Hkv (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: int32 (documents + 1,) on q's device, rising from 0 to exactly
            total_q (total_k) without falling; equal for self-attention over packed documents.
            Documents may be empty (repeated values, trailing ones too), so a batch can pad its
            count of documents to a few fixed sizes.
        max_seqlen_q, max_seqlen_k: ints >= the longest document's lengths (as FlashAttention takes
            them); ``max_seqlen_k`` picks the kernels' tiles. The grid does not depend on them.
        causal, scale, window, softcap: as in ``flash_attention``, inside each document: query i of a
            document of Mq queries and Mk keys sits at position i + (Mk - Mq) (the ends aligned).
        check: also check the values of CUDA cumulative lengths (`check_cu_seqlens`), at the cost of
            one device sync per call. Without it CUDA values are trusted, as in FlashAttention:
            lengths that break the rules above read and write out of bounds or leave rows
            unwritten. CPU cumulative lengths are always checked (the Triton interpreter and the
            reference path alike), as reading them costs no wait. While torch.compile traces, the
            values are not known and not checked.

    Returns (total_q, H, D) in q's dtype; queries that see no key (an empty key document, or a
    mask that hides every key) return 0.

    Raises ``ValueError`` naming the argument for lengths that break the rules, when checked.
    """
    max_seqlen_q, max_seqlen_k = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if (check_flag("check", check) or cu_seqlens_q.device.type == "cpu") and not is_traced(cu_seqlens_q):
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
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
        check_softcap(softcap),
    )


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
    softcap: float | None = None,
) -> torch.Tensor:
    """``flash_attention_varlen``'s semantics by ``flash_attention_ref`` on each document in turn, in
    fp32 (fp64 stays fp64); always checks the cumulative lengths (`check_cu_seqlens`). Returns q's
    dtype promoted to at least fp32. A Python loop over the documents: for tests."""
    max_seqlen_q, max_seqlen_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=(*DTYPES, torch.float64)
    )
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

    def document(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return t[start:end].transpose(0, 1).unsqueeze(0)  # (1, heads, length, D)

    outputs = [
        flash_attention_ref(
            document(q, q0, q1),
            document(k, k0, k1),
            document(v, k0, k1),
            causal=causal,
            scale=scale,
            window=window,
            softcap=softcap,
        )[0].transpose(0, 1)
        for (q0, q1), (k0, k1) in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True)
    ]
    return torch.cat(outputs) if outputs else q.to(torch.promote_types(q.dtype, torch.float32))
