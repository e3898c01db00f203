"""RMSNorm and LayerNorm over the last dim, each switching between fastlm's fused kernel and
PyTorch's ops by the `fastlm.layers.rules` (``kernel``: "fastlm", "torch" or "auto").

The fused path is `fastlm.rms_norm` / `fastlm.layer_norm` writing `kernel_output_dtype`; the
PyTorch path computes the statistics in fp32 and returns x's dtype, as the model always did.
`fused_rms_norm` is the fused path alone, for layers that keep their own PyTorch code (the
Hugging Face patch runs transformers' own forward where the kernel steps aside).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.rules import kernel_output_dtype, runs_kernel
from fastlm.ops.common import check_flag, check_integer, check_number
from fastlm.ops.layer_norm import layer_norm, rms_norm
from fastlm.settings import FUSED_CHOICES


def check_kernel(kernel: str, choices: tuple[str, ...] = FUSED_CHOICES) -> str:
    """``kernel`` if it is one of ``choices``, else ValueError naming them."""
    if kernel not in choices:
        raise ValueError(f"kernel must be one of {', '.join(choices)}, got {kernel!r}")
    return kernel


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, promote: bool = True, weight_offset: float = 0.0
) -> torch.Tensor:
    """`fastlm.rms_norm` in the dtype the layers' rule gives (under autocast its dtype, else the
    promotion of x's and weight's, or x's own with ``promote`` False, as ``(weight * normed).to(x.dtype)``
    writes it): one rounding of ``(weight + weight_offset) * normed`` (``weight_offset`` 1: Gemma's
    ``1 + weight``)."""
    out_dtype = kernel_output_dtype(x, weight if promote else None)
    return rms_norm(x, weight, eps, weight_offset=weight_offset, out_dtype=out_dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight by PyTorch ops in fp32, returned in x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps)
    return (normed if weight is None else normed * weight).to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim of size ``d`` (weight 1), statistics in
    fp32; ``kernel`` picks the fused kernel or PyTorch's ops (module docstring)."""

    def __init__(self, d: int, *, eps: float = 1e-5, elementwise_affine: bool = True, kernel: str = "fastlm") -> None:
        super().__init__()
        d, self.eps = check_integer("d", d, minimum=0), check_number("eps", eps, 0.0)
        self.kernel = check_kernel(kernel)
        self.weight = nn.Parameter(torch.ones(d)) if check_flag("elementwise_affine", elementwise_affine) else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_kernel(self.kernel):
            return fused_rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight={self.weight is not None}, kernel={self.kernel!r}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim of size ``d`` (weight 1, bias 0), statistics in fp32; ``kernel``
    picks the fused kernel or `torch.nn.functional.layer_norm` (module docstring)."""

    def __init__(
        self, d: int, *, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, kernel: str = "fastlm"
    ) -> None:
        super().__init__()
        d, self.eps = check_integer("d", d, minimum=0), check_number("eps", eps, 0.0)
        self.kernel = check_kernel(kernel)
        affine = check_flag("elementwise_affine", elementwise_affine)
        self.weight = nn.Parameter(torch.ones(d)) if affine else None
        self.bias = nn.Parameter(torch.zeros(d)) if affine and check_flag("bias", bias) else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if runs_kernel(self.kernel):
            return layer_norm(x, self.weight, self.bias, self.eps, out_dtype=kernel_output_dtype(x, self.weight))
        return F.layer_norm(x.float(), x.shape[-1:], self.weight, self.bias, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, weight={self.weight is not None}, bias={self.bias is not None}, kernel={self.kernel!r}"
