"""Thin ``nn.Module`` wrappers over fastlm's functional ops; every flag is passed through, and
checked when the module is made."""

from __future__ import annotations

import torch

from fastlm.ops.common import check_flag, check_integer, check_number
from fastlm.ops.cross_entropy import check_options, cross_entropy
from fastlm.ops.layer_norm import layer_norm, rms_norm
from fastlm.ops.linear_cross_entropy import check_options as check_linear_options
from fastlm.ops.linear_cross_entropy import linear_cross_entropy


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


class LinearCrossEntropyLoss(torch.nn.Module):
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


class LayerNorm(torch.nn.Module):
    """Module form of :func:`fastlm.layer_norm` over the last dim of size ``d`` (weight 1, bias 0)."""

    def __init__(self, d: int, *, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True) -> None:
        super().__init__()
        d, self.eps = check_integer("d", d, minimum=0), check_number("eps", eps, 0.0)
        affine = check_flag("elementwise_affine", elementwise_affine)
        self.weight = torch.nn.Parameter(torch.ones(d)) if affine else None
        self.bias = torch.nn.Parameter(torch.zeros(d)) if affine and check_flag("bias", bias) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}"


class RMSNorm(torch.nn.Module):
    """Module form of :func:`fastlm.rms_norm` over the last dim of size ``d`` (weight 1)."""

    def __init__(self, d: int, *, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        d, self.eps = check_integer("d", d, minimum=0), check_number("eps", eps, 0.0)
        affine = check_flag("elementwise_affine", elementwise_affine)
        self.weight = torch.nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight={self.weight is not None}"
