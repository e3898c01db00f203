"""RoPE as a layer: the cos/sin tables and the switch between `fastlm.rotary_embedding` and PyTorch's ops."""

from __future__ import annotations

import torch
from torch import nn

from fastlm.layers.norms import check_kernel
from fastlm.layers.rules import runs_kernel
from fastlm.ops.rotary import DTYPES as ROTARY_DTYPES
from fastlm.ops.rotary import rotary_embedding, rotate_half


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str):
    """q (B, H, N, Dh) and k (B, Hkv, N, Dh) rotated by the (>= N, Dh/2) tables, row n for token n:
    one launch for both each way where ``kernel`` runs the fused kernel (PyTorch's version is about
    ten ops per tensor each way), else PyTorch's ops. The kernel takes fp32 tables (a model cast to
    another dtype casts them too: they come back in fp32, no copy when they are) and no float64."""
    if runs_kernel(kernel) and q.dtype in ROTARY_DTYPES:
        return rotary_embedding(q, k, cos.float(), sin.float())
    n = q.shape[-2]
    return rotate_half(q, cos[:n], sin[:n]), rotate_half(k, cos[:n], sin[:n])


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x_i, x_{i+Dh/2}) of a head vector at position p by p * theta^(-2i/Dh).

    This is the "rotate half" pairing (GPT-NeoX, Llama in Hugging Face); it equals the interleaved
    pairing of the paper up to a fixed permutation of the q/k projection rows. cos/sin tables
    (context, Dh/2) are fp32 buffers, not parameters; ``kernel`` as `rotate` takes it.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float, kernel: str = "fastlm") -> None:
        super().__init__()
        self.kernel, self.theta = check_kernel(kernel), theta
        tables = (context_length, head_dim // 2)
        self.register_buffer("cos", torch.empty(tables, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(tables, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The cos/sin tables (buffers, no parameters: the name is the one `materialize` calls)."""
        context_length, half = self.cos.shape
        device = self.cos.device
        inverse_frequency = self.theta ** (
            -torch.arange(0, 2 * half, 2, dtype=torch.float64, device=device) / (2 * half)
        )
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64, device=device), inverse_frequency)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, N, Dh) -> the same shapes and dtypes, position p = index along N."""
        return rotate(q, k, self.cos, self.sin, self.kernel)
