"""The eager CPU path: torch's ``scaled_dot_product_attention`` (its C++ CPU kernel, fp32
accumulation), differentiated by autograd, with `flash_attention`'s semantics.

The tiled twin (tiled.py) spells the kernels' algorithm out in Python, one step per key tile: on a
CPU those steps cost more than their arithmetic. Here a dense batch is one SDPA call, and packed
documents are gathered by length: the documents of each distinct (queries, keys) length pair go
through one batched call, so a batch costs at most about sqrt(2 x rows) calls (distinct lengths
summing to at most the rows), however many documents it holds. The cumulative lengths are read on
the host (free on a CPU). While torch.compile traces, the op runs the tiled twin instead: each
document's place is data then.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import torch
import torch.nn.functional as F

from fastlm.ops.flash_attention.masks import visible, window_bounds


def _attend(q, k, v, causal: bool, scale: float, window: tuple[int, int]) -> torch.Tensor:
    """SDPA of 4-D q (Z, H, M, D) and k, v (Z, Hkv, N, D) under the causal flag and the window
    (masks.py: bottom-right aligned); rows that see no key return 0."""
    M, N = q.shape[2], k.shape[2]
    if N == 0:
        return q.new_zeros(q.shape)
    left, right = window_bounds(causal, window)
    mask, is_causal = None, False
    if causal and left < 0 and M == N:
        is_causal = True  # SDPA's own causal mask: top-left, the same as bottom-right when M == N
    elif left >= 0 or right >= 0:
        positions = torch.arange(M, device=q.device) + (N - M)
        mask = visible(positions, torch.arange(N, device=q.device), left, right)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    if mask is not None:  # rows whose mask hides every key: 0, as the kernels write them
        out = out.masked_fill(~mask.any(-1)[:, None], 0.0)
    return out


def sdpa_attention(
    q, k, v, causal: bool, scale: float, window: tuple[int, int], cu_seqlens_q=None, cu_seqlens_k=None
) -> torch.Tensor:
    """The output for checked arguments, as `attend` takes them: dense q (Z, H, M, D) or (Z, M, D),
    or packed (total, H, D) with cumulative lengths (CPU tensors, checked); q, k and v not empty
    (the tiled twin serves those, with gradients for all three)."""
    if cu_seqlens_q is None:
        if q.dim() == 3:
            return _attend(q[:, None], k[:, None], v[:, None], causal, scale, window)[:, 0]
        return _attend(q, k, v, causal, scale, window)
    groups = defaultdict(lambda: ([], []))  # (queries, keys) -> (first query rows, first key rows)
    for (q0, q1), (k0, k1) in zip(pairwise(cu_seqlens_q.tolist()), pairwise(cu_seqlens_k.tolist()), strict=True):
        if q1 > q0:
            starts_q, starts_k = groups[q1 - q0, k1 - k0]
            starts_q.append(q0)
            starts_k.append(k0)
    pieces, rows = [], []
    for (queries, keys), (starts_q, starts_k) in groups.items():
        # (documents, length) row indices; gathered (documents, length, heads, D) -> (documents, heads, length, D)
        index_q = torch.tensor(starts_q)[:, None] + torch.arange(queries)
        index_k = torch.tensor(starts_k)[:, None] + torch.arange(keys)
        out = _attend(*(t[index].transpose(1, 2) for t, index in ((q, index_q), (k, index_k), (v, index_k))),
                      causal, scale, window)  # fmt: skip
        pieces.append(out.transpose(1, 2).flatten(0, 1))
        rows.append(index_q.flatten())
    order = torch.cat(rows)  # each row of q once: the documents cover them all
    return torch.cat(pieces)[torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))]
