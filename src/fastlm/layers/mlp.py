"""The gated feed-forward, down(act(gate(x)) * up(x)): the SwiGLU MLP, and the gating by `fastlm.swiglu`
/ `fastlm.geglu` or PyTorch for any gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.layers.linear import Linear
from fastlm.layers.norms import check_kernel
from fastlm.layers.rules import runs_kernel
from fastlm.ops.swiglu import geglu, swiglu

# the activations of a gated MLP that fastlm fuses: SiLU (`fastlm.swiglu`) and GELU (`fastlm.geglu`)
# in its tanh form or exact (`torch.nn.functional.gelu`'s approximate "tanh" / "none")
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_GELU_APPROXIMATE = {"gelu_tanh": "tanh", "gelu": "none"}


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, kernel: str) -> torch.Tensor:
    """activation(gate) * up, ``activation`` one of `GATED_ACTIVATIONS`: one launch each way where
    ``kernel`` runs the fused kernel (eager PyTorch moves 14 elements per gated element for fwd+bwd,
    the kernel 8), else PyTorch's ops, which torch.compile fuses as well."""
    if activation == "silu":
        return swiglu(gate, up) if runs_kernel(kernel) else F.silu(gate) * up
    approximate = _GELU_APPROXIMATE[activation]
    return geglu(gate, up, approximate) if runs_kernel(kernel) else F.gelu(gate, approximate=approximate) * up


def swiglu_mlp(x: torch.Tensor, gate: nn.Module, up: nn.Module, down: nn.Module, kernel: str) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for any three projections, the gating by `gated_activation`."""
    return down(gated_activation(gate(x), up(x), "silu", kernel))


class SwiGLUMLP(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases: (B, N, d) -> (B, N, d) through a (B, N, d_ff) hidden layer."""

    def __init__(self, d_model: int, d_ff: int, kernel: str = "fastlm") -> None:
        super().__init__()
        self.kernel = check_kernel(kernel)
        self.w1, self.w3, self.w2 = Linear(d_model, d_ff), Linear(d_model, d_ff), Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.w1, self.w3, self.w2, self.kernel)
