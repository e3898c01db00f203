"""`apply_fastlm(model, fp8=True)`: the decoder layers' linear layers through `fastlm.fp8_linear`.

Converted: every ``nn.Linear`` of the base model (attention projections, MLP projections) whose
in and out features are multiples of 16 (the FP8 matmuls' rule). Kept in the weights' dtype: the
LM head (its logits feed the loss, the largest and most sensitive matmul), the embeddings (not
matmuls), and the routers of mixtures of experts (``gate`` / ``router`` modules: a few outputs,
whose top-k choice a rounding can flip).
"""

from __future__ import annotations

import torch

from fastlm.ops.fp8_linear import FP8_MULTIPLE, fp8_linear

ROUTER_NAMES = ("gate", "router")


def fp8_layers(model) -> list[torch.nn.Module]:
    """The linear layers of ``model`` (a transformers model, not a PEFT wrapper) that fp8 converts."""
    head = model.get_output_embeddings()
    return [
        module
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear
        and module is not head
        and name.rsplit(".", 1)[-1] not in ROUTER_NAMES
        and module.in_features % FP8_MULTIPLE == 0
        and module.out_features % FP8_MULTIPLE == 0
    ]


def fp8_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` by `fastlm.fp8_linear`; under autocast the input in the autocast
    dtype (as autocast casts a linear layer's input) and the output in it."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return fp8_linear(x.to(dtype), self.weight, self.bias)
    return fp8_linear(x, self.weight, self.bias)
