"""Thin ``nn.Module`` wrappers over fastlm's functional ops; every flag is passed through."""

from __future__ import annotations

import torch

from fastlm.ops.cross_entropy import cross_entropy


class CrossEntropyLoss(torch.nn.Module):
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
