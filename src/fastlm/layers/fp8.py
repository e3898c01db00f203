"""Linear layers through `fastlm.fp8_linear`: the forward the model (``--precision fp8``) and the
Hugging Face patch (``apply_fastlm(model, fp8=True)``) put in a layer's place."""

from __future__ import annotations

import types

import torch

from fastlm.ops.fp8_linear import FP8_MULTIPLE, fp8_linear

# the names of layers that stay in the weights' dtype wherever they sit: routers of mixtures of
# experts (a few outputs, whose top-k choice a rounding can flip)
ROUTER_NAMES = ("gate", "router")


def fp8_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward (its ``weight``, and ``bias`` if it has one) by `fastlm.fp8_linear`;
    under autocast the input in the autocast dtype (as autocast casts a linear layer's input) and
    the output in it."""
    bias = getattr(self, "bias", None)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return fp8_linear(x.to(dtype), self.weight, bias)
    return fp8_linear(x, self.weight, bias)


def fits_fp8(weight: torch.Tensor) -> bool:
    """Whether a (N, K) weight's matmuls fit FP8's rule: K and N multiples of 16."""
    return weight.shape[0] % FP8_MULTIPLE == 0 and weight.shape[1] % FP8_MULTIPLE == 0


def convert_to_fp8(module: torch.nn.Module) -> None:
    """``module``'s forward becomes `fp8_linear_forward`, an attribute of the instance (a deep copy
    keeps it; deleting it brings the class's back)."""
    module.forward = types.MethodType(fp8_linear_forward, module)
