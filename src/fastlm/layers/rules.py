"""The two rules every layer follows, written once: when a fused kernel runs, and what dtype it writes.

1. A switch of `fastlm.settings.Kernels` says which kernel a layer runs: "fastlm" always, "torch"
   never, "auto" in eager mode only. While torch.compile traces, "auto" layers run PyTorch's ops,
   which Inductor fuses into the kernels of their neighbours (the residual add before a norm, the
   casts around it): a separate kernel would read and write the activations once more.
2. Under autocast a fused kernel writes the autocast dtype: what it feeds (a Linear, attention)
   casts to that dtype anyway, so the values are the same and a full-width fp32 write and a cast
   pass are saved. Outside autocast it writes the promotion of its input's and its weight's dtypes,
   as ``weight * normed`` would in PyTorch.
"""

from __future__ import annotations

import torch

from fastlm.settings import runs_fused


def runs_kernel(switch: str) -> bool:
    """Whether the fused kernel of a layer whose switch is ``switch`` runs now (rule 1)."""
    return runs_fused(switch, torch.compiler.is_compiling())


def kernel_output_dtype(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.dtype:
    """The dtype a fused kernel writes for input ``x`` with ``weight`` (rule 2)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
