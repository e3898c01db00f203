"""The model's bias-free Linear and Embedding, with their initializations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std) clipped at 3 standard deviations, in place."""
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T without bias; W (d_out, d_in) ~ truncated normal, std sqrt(2 / (d_in + d_out))."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d_out, d_in = self.weight.shape
        trunc_normal_(self.weight, math.sqrt(2.0 / (d_in + d_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[1]}, d_out={self.weight.shape[0]}"


def linear_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights of the linear layers inside ``module`` (this file's `Linear` and
    `torch.nn.Linear`): the matmul weights that a ``param_dtype`` group of `fastlm.optim.AdamW`
    can store in bf16 (docs/optim.md)."""
    return [m.weight for m in module.modules() if isinstance(m, (Linear, nn.Linear))]


class Embedding(nn.Module):
    """Token ids (B, N) -> vectors (B, N, d); table (V, d) ~ truncated normal with std 1."""

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        trunc_normal_(self.weight, 1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # F.embedding, not weight[tokens]: its backward is the dedicated embedding kernel, not a
        # general index_put with accumulation
        return F.embedding(tokens, self.weight)
