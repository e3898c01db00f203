"""The memory layout of attention's results: 4-D ones token-major, whatever the inputs' layout.

The model (and the Hugging Face patch) hands attention (B, H, N, D) views of (B, N, H, D)
projections and reads its output back as (B, N, H * D) for the output projection. A result laid
out contiguous as (B, H, N, D) makes that transpose a copy each way (2 bytes per element read and
written in bf16); in (B, N, H, D) memory it is a view, as with SDPA's output. The kernels and the
tiled twin return the same layouts, so what torch.compile's traced run reports is what runs.
"""

from __future__ import annotations

import torch


def empty_token_major(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialized, ``t``'s shape (``dtype``, default ``t``'s): 4-D (Z, H, rows, D) in
    (Z, rows, H, D) memory; 3-D (dense (Z, rows, D), packed (total, H, D)) contiguous, already
    row-major.

    Allocated with ``torch.empty`` (4-D: a transposed view of one), never ``empty_strided``: under
    torch.compile, common-subexpression elimination merges identical ``empty_strided`` calls (it
    spares only ``empty``), so every layer's result would share one buffer and each kernel launch
    that writes it would first get a full copy of it."""
    dtype = dtype or t.dtype
    if t.dim() != 4:
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    z, heads, rows, d = t.shape
    return torch.empty((z, rows, heads, d), dtype=dtype, device=t.device).transpose(1, 2)


def empty_like_output(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialized, with the strides of an O from `kernel_ready_output` (contiguous or
    token-major): dQ, which the dQ kernel indexes with O's strides."""
    if o.is_contiguous():
        return torch.empty(o.shape, dtype=dtype, device=o.device)
    return empty_token_major(o, dtype)


def kernel_ready_output(o: torch.Tensor) -> torch.Tensor:
    """O for the backward, whose dQ takes O's strides: as the forward made it (token-major or
    contiguous), else a contiguous copy (an O with gaps, overlaps or strided D)."""
    if o.is_contiguous() or (o.dim() == 4 and o.transpose(1, 2).is_contiguous()):
        return o
    return o.contiguous()
