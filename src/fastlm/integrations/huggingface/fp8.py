"""`apply_fastlm(model, fp8=True)`: the decoder layers' linear layers through `fastlm.fp8_linear`.

Converted: every ``nn.Linear`` of the base model (attention projections, MLP projections) whose
in and out features are multiples of 16 (the FP8 matmuls' rule). Kept in the weights' dtype: the
LM head (its logits feed the loss, the largest and most sensitive matmul), the embeddings (not
matmuls), the routers of mixtures of experts (``gate`` / ``router`` modules: a few outputs,
whose top-k choice a rounding can flip), and a PEFT model's adapters.
"""

from __future__ import annotations

import torch

from fastlm.layers.fp8 import ROUTER_NAMES, fits_fp8

# PEFT's modules inside a wrapped layer: its adapters (lora_A, lora_B, ...) and the copies
# modules_to_save keeps train in the weights' dtype, as the layers they adapt would not tell
PEFT_PARTS = ("modules_to_save", "original_module")


def _kept(name: str) -> bool:
    """Whether the module at ``name`` stays as it is: a router's, or one of PEFT's own."""
    parts = name.split(".")
    return any(part in ROUTER_NAMES or part in PEFT_PARTS or part.startswith("lora_") for part in parts)


def fp8_layers(model) -> list[torch.nn.Module]:
    """The linear layers of ``model`` (a transformers model; under PEFT the adapted one) that fp8
    converts: not the LM head nor anything inside it (PEFT's base_layer of an adapted head)."""
    head = model.get_output_embeddings()
    in_head = set() if head is None else set(head.modules())
    return [
        module
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and module not in in_head and not _kept(name) and fits_fp8(module.weight)
    ]
