"""The global gradient norm that clipping scales by, shared by the training loop and the
data-parallel buckets (which clip while handing gradients out), so both sum it in one order."""

from __future__ import annotations

import torch


def grad_norm(values: list[torch.Tensor], dtypes: list[torch.dtype] | None = None) -> torch.Tensor:
    """The 2-norm of ``values``, the gradients in parameter order, as a 0-dim tensor in fp32 (fp64
    for fp64 values). ``values`` may hold a gradient in another dtype than its own (a bf16 copy of
    an fp32 gradient: its every value is exact); ``dtypes`` then gives the gradients' own.

    Per-tensor norms in one multi-tensor launch per dtype of ``values``, combined grouped by the
    gradients' dtypes in order of first appearance, parameter order within a group: for gradients
    of one dtype the order `torch.nn.utils.clip_grad_norm_` sums them in. Unlike it, a bf16
    gradient's norm is taken in fp32 (it returns a bf16 norm, 0.1% off, and clips by that).
    """
    if not values:
        return torch.zeros(())
    dtypes = dtypes or [v.dtype for v in values]
    norms: list[torch.Tensor | None] = [None] * len(values)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(index)
    for dtype, indices in by_dtype.items():
        found = torch._foreach_norm([values[i] for i in indices], 2.0, dtype=torch.promote_types(dtype, torch.float32))
        for index, norm in zip(indices, found, strict=True):
            norms[index] = norm
    first: dict[torch.dtype, int] = {}
    for dtype in dtypes:
        first.setdefault(dtype, len(first))
    order = sorted(range(len(values)), key=lambda i: first[dtypes[i]])
    return torch.linalg.vector_norm(torch.stack([norms[i] for i in order]))
