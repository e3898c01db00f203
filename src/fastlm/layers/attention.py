"""Causal self-attention as a layer: the projections, RoPE, and the attention itself by one of three
kernels (``kernel``): "fastlm" (`fastlm.flash_attention`, packed documents through
`fastlm.flash_attention_varlen`), "sdpa" (torch's scaled_dot_product_attention) or "naive" (the
(B, H, N, N) scores materialized, with ``softmax`` "fastlm" fusing scale, mask and softmax).

Documents and windows: fastlm reads packed documents from ``cu_seqlens`` (int32 cumulative lengths
over the B N tokens laid end to end, every row starting a document) and skips the tiles outside a
window; naive and sdpa take both as a boolean mask, `attention_mask`'s, which the model builds once
per forward for all its layers.

Ranges named "attention/scores|mask|softmax|output" inside the naive path show up in profiles when
`fastlm.layers.ranges.annotations()` is on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.linear import Linear
from fastlm.layers.norms import check_kernel
from fastlm.layers.ranges import annotate
from fastlm.layers.rotary import RotaryEmbedding
from fastlm.ops.flash_attention import flash_attention, flash_attention_varlen
from fastlm.ops.masked_softmax import masked_softmax
from fastlm.settings import SWITCH_CHOICES


def flash_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, H, Nq, D), k and v (B, Hkv, Nk, D), grouped heads read in place -> (B, Nq, H, D) (a view
    of the kernels' token-major output). ``window``: query i sees the ``window`` keys up to and
    including i. With cu_seqlens_q/k the rows are packed documents laid end to end (none spans two
    rows), each attending within itself; max_seqlen_q/k bound their lengths. ``softcap``: the
    scores' softcap, as in `fastlm.flash_attention`."""
    kernel_window = None if window is None else (window - 1, 0)
    if cu_seqlens_q is None:
        out = flash_attention(q, k, v, causal=True, scale=scale, window=kernel_window, softcap=softcap)
        return out.transpose(1, 2)
    batch, heads, length, head_dim = q.shape

    def packed(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (B N, H, D): a view for one row
        return t.transpose(1, 2).reshape(batch * t.shape[2], t.shape[1], head_dim)

    out = flash_attention_varlen(
        packed(q),
        packed(k),
        packed(v),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=True,
        scale=scale,
        window=kernel_window,
        softcap=softcap,
    )
    return out.view(batch, length, heads, head_dim)


def unpadded_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention within the real tokens of each row of a padded batch: q (B, H, N, D), k and
    v (B, Hkv, N, D) -> (B, N, H, D), 0 at the padded positions.

    The T real tokens sit at (rows[t], positions[t]), t < T, int64 (T,), row-major with each row's
    tokens contiguous (right or left padding); cu_seqlens (B + 1,) int32 cumulates the rows' real
    lengths, max_seqlen the longest. The real tokens are gathered into (T, heads, D), one pass over
    each of q, k and v whatever their strides; they attend as one document per row through
    `fastlm.flash_attention_varlen` (``window``: query i sees the ``window`` keys up to and including
    i, as in `flash_causal_attention`; a row's tokens keep their distances, so the window is the
    row's; ``softcap`` as there); the output is scattered into a zeroed (B, N, H, D) in one pass.
    Cost beyond the kernel: q, k, v and the output of the T real tokens read and written once more, as much again in the
    backward; what it saves is the attention of the B N - T padded queries."""
    batch, heads, length, head_dim = q.shape
    kernel_window = None if window is None else (window - 1, 0)

    def unpadded(t: torch.Tensor) -> torch.Tensor:  # (B, h, N, D) -> (T, h, D): the real tokens
        return t[rows, :, positions]

    out = flash_attention_varlen(
        unpadded(q),
        unpadded(k),
        unpadded(v),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        causal=True,
        scale=scale,
        window=kernel_window,
        softcap=softcap,
    )  # (T, H, D)
    return out.new_zeros(batch, length, heads, head_dim).index_put((rows, positions), out)


def naive_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax: str = "torch", allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) + causal mask) v with the (B, H, N, N) scores materialized; each
    stage is a named range so profiles can set softmax time against matmul time. ``softmax``
    "fastlm" fuses scale, causal mask and softmax into one `fastlm.masked_softmax` kernel.
    ``allowed`` (B or 1, 1, N, N) bool, `attention_mask`'s, narrows the causal mask further."""
    n, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    if softmax == "fastlm":
        with annotate("attention/scores"):
            scores = q @ k.transpose(-2, -1)
        with annotate("attention/softmax"):
            extra = None
            if allowed is not None:
                extra = torch.zeros_like(allowed, dtype=q.dtype).masked_fill(~allowed, -math.inf)
            probs = masked_softmax(scores, extra, scale=scale, causal=True)
    else:
        with annotate("attention/scores"):
            scores = (q @ k.transpose(-2, -1)) * scale
        with annotate("attention/mask"):
            hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            if allowed is not None:
                hidden = hidden | ~allowed
            scores = scores.masked_fill(hidden, float("-inf"))
        with annotate("attention/softmax"):
            probs = torch.softmax(scores, dim=-1)
    with annotate("attention/output"):
        return probs.to(v.dtype) @ v


def document_segments(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(B, N) int: the document index of every token, from cumulative lengths over the B N tokens
    (empty documents at the end, padding, take no token)."""
    positions = torch.arange(batch * length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True).view(batch, length)


def attention_mask(segments: torch.Tensor | None, length: int, window: int | None, device) -> torch.Tensor:
    """(B or 1, 1, N, N) bool, True where query i may see key j beyond causality: the same document
    (``segments`` (B, N), or None: one per row) and, with ``window``, i - j < window."""
    query, key = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    allowed = key <= query if window is None else (key <= query) & (query - key < window)
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    return allowed.view(-1, 1, length, length)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/output projections (no biases) and RoPE
    on q and k: (B, N, d) -> (B, N, d). ``rope`` may be shared by every layer of a model."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rope: RotaryEmbedding,
        *,
        window: int | None = None,
        kernel: str = "fastlm",
        softmax: str = "torch",
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.kernel = check_kernel(kernel, SWITCH_CHOICES["attention"])
        self.softmax, self.window = check_kernel(softmax, SWITCH_CHOICES["softmax"]), window
        d = d_model
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = Linear(d, d), Linear(d, d), Linear(d, d), Linear(d, d)
        self.rope = rope

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, N, d); fastlm reads the documents from ``cu_seqlens``, naive and sdpa from
        ``allowed``, this layer's `attention_mask` (None: plain causal attention)."""
        b, n, d = x.shape
        if self.kernel != "fastlm" and allowed is None and (cu_seqlens is not None or self.window is not None):
            raise ValueError("naive and sdpa attention take documents and windows as a mask (allowed)")

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, d) -> (B, H, N, Dh)
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = self.rope(q, k)
        if self.kernel == "fastlm":  # documents no longer than a row (N)
            out = flash_causal_attention(
                q,
                k,
                v,
                window=self.window,
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=n,
                max_seqlen_k=n,
            )  # (B, N, H, Dh)
            return self.o_proj(out.reshape(b, n, d))
        if self.kernel == "naive":
            out = naive_causal_attention(q, k, v, self.softmax, allowed)
        elif allowed is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))
