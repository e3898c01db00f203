"""The memory layout of attention's results.

The output is token-major whatever the inputs' layout: the model (and the Hugging Face patch) hands
attention (B, H, N, D) views of (B, N, H, D) projections and reads its output back as (B, N, H * D)
for the output projection. A result laid out contiguous as (B, H, N, D) makes that transpose a copy
each way (2 bytes per element read and written in bf16); in (B, N, H, D) memory it is a view, as
with SDPA's output.

The gradients are contiguous where their inputs are (dK and dV, which the kernel writes with one set
of strides, where k and v both are), else token-major: a contiguous leaf (a benchmark's inputs, a
user's own tensors) then takes its gradient without a copy (autograd copies a gradient whose strides
differ from its leaf's), and the model's views get the layout that makes their way back to the
projections a view.

The kernels and the tiled twin return the same layouts, so what torch.compile's traced run reports
is what runs.
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


def contiguous_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, bool]:
    """Whether dq, and dk with dv, are laid out contiguous (else token-major): where q, and k and v
    both, are."""
    return q.is_contiguous(), k.is_contiguous() and v.is_contiguous()


def empty_result(t: torch.Tensor, contiguous: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialized, ``t``'s shape: contiguous, or `empty_token_major`; also from ``torch.empty``."""
    if contiguous:
        return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    return empty_token_major(t, dtype)


def kernel_ready_output(o: torch.Tensor) -> torch.Tensor:
    """O for the backward, which reads it through its strides in rows of unit stride along D: as
    the forward made it (token-major 4-D, contiguous 3-D or packed), else a contiguous copy (an O
    that the op's caller changed: gaps, overlaps or strided D)."""
    if o.is_contiguous() or (o.dim() == 4 and o.transpose(1, 2).is_contiguous()):
        return o
    return o.contiguous()
