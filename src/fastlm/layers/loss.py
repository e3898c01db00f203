"""Losses as layers: `LMHeadLoss`, the LM head and the next-token loss with the kernel switch, and the
module forms of `fastlm.cross_entropy` and `fastlm.linear_cross_entropy` (every option passed
through, checked when the module is made)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.norms import check_kernel
from fastlm.ops.cross_entropy import check_options, cross_entropy
from fastlm.ops.linear_cross_entropy import check_options as check_linear_options
from fastlm.ops.linear_cross_entropy import linear_cross_entropy
from fastlm.settings import SWITCH_CHOICES


def lm_head_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    kernel: str = "fastlm",
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """cross_entropy(head(hidden), targets) for a linear ``head`` (its ``weight`` (V, d) and
    ``bias`` (V,) if it has one): hidden (..., d) and targets (...), the leading dims flattened into
    T tokens; with ``softcap`` c the logits are c * tanh(logits / c) first (Gemma 2). "fastlm" runs
    `fastlm.linear_cross_entropy`, which computes the head's matmul chunk by chunk and never holds
    the (T, V) logits (the head's forward does not run); "torch" the head and then
    `F.cross_entropy`."""
    if kernel == "fastlm":
        bias = getattr(head, "bias", None)
        rows = hidden.reshape(-1, hidden.shape[-1])
        return linear_cross_entropy(
            rows,
            head.weight,
            targets.reshape(-1),
            bias,
            ignore_index=ignore_index,
            reduction=reduction,
            softcap=softcap,
        )
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


class LMHeadLoss(nn.Module):
    """`lm_head_loss` as a module holding its switch and options: ``loss(hidden, head, targets)``.
    It holds no weight: the model passes its LM head in."""

    def __init__(self, kernel: str = "fastlm", *, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        self.kernel = check_kernel(kernel, SWITCH_CHOICES["loss"])
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
        return lm_head_loss(
            hidden, head, targets, kernel=self.kernel, ignore_index=self.ignore_index, reduction=self.reduction
        )

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, ignore_index={self.ignore_index}, reduction={self.reduction!r}"


class CrossEntropyLoss(nn.Module):
    """Module form of :func:`fastlm.cross_entropy` (same arguments, same semantics)."""

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        fused: bool = True,
        inplace: bool = False,
    ) -> None:
        super().__init__()
        ignore_index, label_smoothing, z_loss = check_options(
            ignore_index, reduction, label_smoothing, z_loss, fused, inplace
        )
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.fused = fused
        self.inplace = inplace

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            logits,
            targets,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            fused=self.fused,
            inplace=self.inplace,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, fused={self.fused}, inplace={self.inplace}"
        )


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fastlm.linear_cross_entropy` (same options): ``loss(hidden, weight,
    targets, bias=None)``. It holds no weight: the LM head that owns it passes it in."""

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        chunk_rows: int | None = None,
    ) -> None:
        super().__init__()
        ignore_index, label_smoothing, z_loss, softcap, chunk_rows = check_linear_options(
            reduction, ignore_index, label_smoothing, z_loss, softcap, chunk_rows
        )
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.chunk_rows = chunk_rows

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            weight,
            targets,
            bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            chunk_rows=self.chunk_rows,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, softcap={self.softcap}, chunk_rows={self.chunk_rows}"
        )
