"""Which transformers modules of each model family get which forward: one small adapter per family,
keyed by ``config.model_type``. A family whose modules share Llama's attribute names and forwards
(input_layernorm, q_proj ... o_proj, gate_proj / up_proj / down_proj, model.layers, lm_head) is one
line: its class-name prefix."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.integrations.huggingface import forwards

SWIGLU_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class Adapter:
    """The module classes of a Llama-like family, by their name prefix (LlamaRMSNorm, LlamaMLP,
    LlamaAttention, LlamaModel, LlamaForCausalLM) and the forward each switch binds to them."""

    prefix: str

    def replacements(self, model) -> dict[str, dict[str, tuple]]:
        """switch -> {class name: (forward, whether it takes the switch's value)} for ``model`` (the
        transformers model, not a PEFT wrapper); "mlp" only where the config's activation is
        SwiGLU's (the caller warns otherwise)."""
        p = self.prefix
        swaps = {
            "norm": {f"{p}RMSNorm": (forwards.rms_norm_forward, True)},
            "rope": {f"{p}Attention": (forwards.attention_forward, True)},
            "attention": {f"{p}Model": (forwards.base_model_forward, False)},
            # the model itself, when it is the causal LM, under its own forward's signature
            "loss": {f"{p}ForCausalLM": (forwards.signed_like(type(model).forward), False)},
        }
        if getattr(model.config, "hidden_act", None) in SWIGLU_ACTIVATIONS:
            swaps["mlp"] = {f"{p}MLP": (forwards.mlp_forward, True)}
        return swaps


ADAPTERS = {
    "llama": Adapter("Llama"),
    "mistral": Adapter("Mistral"),
    "qwen2": Adapter("Qwen2"),
    "qwen3": Adapter("Qwen3"),
}
FAMILIES = tuple(ADAPTERS)


def adapter_for(model) -> Adapter:
    """The adapter of ``model``'s family, or ValueError naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"apply_fastlm supports the transformers model types {', '.join(ADAPTERS)}; got "
            f"{type(model).__name__} with model_type {model_type!r}"
        )
    return ADAPTERS[model_type]
