"""The SwiGLU feed-forward, down(silu(gate(x)) * up(x)), with the gating by `fastlm.swiglu` or PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.linear import Linear
from fastlm.layers.norms import check_kernel
from fastlm.layers.rules import runs_kernel
from fastlm.ops.swiglu import swiglu


def swiglu_mlp(x: torch.Tensor, gate: nn.Module, up: nn.Module, down: nn.Module, kernel: str) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for any three projections: the gating in one launch each way where
    ``kernel`` runs the fused kernel (eager PyTorch moves 14 elements per gated element for fwd+bwd,
    the kernel 8), else PyTorch's ops, which torch.compile fuses as well."""
    if runs_kernel(kernel):
        return down(swiglu(gate(x), up(x)))
    return down(F.silu(gate(x)) * up(x))


def fused_gate_up_swiglu_mlp(x: torch.Tensor, gate_up: nn.Module, down: nn.Module, kernel: str) -> torch.Tensor:
    """down(silu(gate) * up) where (gate, up) = gate_up(x).chunk(2, -1): one projection holding both
    (Phi-3's and GLM-4's gate_up_proj). The kernel reads the two halves in place (no copy)."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    if runs_kernel(kernel):
        return down(swiglu(gate, up))
    return down(F.silu(gate) * up)


class SwiGLUMLP(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases: (B, N, d) -> (B, N, d) through a (B, N, d_ff) hidden layer."""

    def __init__(self, d_model: int, d_ff: int, kernel: str = "fastlm") -> None:
        super().__init__()
        self.kernel = check_kernel(kernel)
        self.w1, self.w3, self.w2 = Linear(d_model, d_ff), Linear(d_model, d_ff), Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.w1, self.w3, self.w2, self.kernel)
