"""The "fastlm" experts implementation of transformers' ``ExpertsInterface``: a model built with
``experts_implementation="fastlm"`` (or switched by ``model.set_experts_implementation("fastlm")``)
runs its experts by `fastlm.ops.moe.moe_experts`, in eager mode and under torch.compile, with or
without `apply_fastlm`:

    from fastlm.integrations.huggingface import register_experts
    register_experts()
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fastlm")

Experts whose layout or math the kernels do not compute (biases, transposed or interleaved
weights, a post-expert norm, no gate, an activation other than those `EXPERT_ACTIVATIONS` names:
GPT-OSS's among them) run transformers' ``grouped_mm`` implementation instead.
"""

from __future__ import annotations

import torch

from fastlm.layers.moe import experts_output

EXPERTS_IMPLEMENTATION = "fastlm"
# transformers' activation names (config.hidden_act) -> the gating `moe_experts` fuses, exactly
EXPERT_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
FALLBACK = "grouped_mm"


def layout_fits(experts: torch.nn.Module) -> bool:
    """Whether a transformers experts module's weights are laid out as `moe_experts` takes them:
    gated, concatenated [gate; up] rows, not transposed, no biases, no post-expert norm (the flags
    transformers' ``use_experts_implementation`` sets; a module without them is Mixtral's kind)."""
    return (
        getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_post_expert_norm", False)
    )


def kernel_activation(experts: torch.nn.Module) -> str | None:
    """The `moe_experts` activation of a transformers experts module, None where its layout or
    activation (its config's hidden_act) is not one the kernels compute."""
    config = getattr(experts, "config", None)
    return EXPERT_ACTIVATIONS.get(getattr(config, "hidden_act", None)) if layout_fits(experts) else None


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output (T, D) for tokens (T, D) and their routes (T, K), as the interface
    calls an implementation (gate_up_proj (E, 2I, D), down_proj (E, D, I))."""
    activation = kernel_activation(self)
    if activation is None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[FALLBACK](self, hidden_states, top_k_index, top_k_weights)
    return experts_output(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, activation)


def register_experts() -> str:
    """Register `experts_forward` in transformers' ``ExpertsInterface`` as "fastlm" (for every
    model built afterwards, as transformers' own implementations are); returns the name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return EXPERTS_IMPLEMENTATION
