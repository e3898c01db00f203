"""Which transformers modules of each model family get which forward: one small adapter per family,
keyed by ``config.model_type``. A family whose modules share Llama's attribute names and forwards
(input_layernorm, q_proj ... o_proj, gate_proj / up_proj / down_proj, model.layers, lm_head) is one
line: its class-name prefix, with a field for each way its math differs where no module shows it."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.integrations.huggingface import forwards

SWIGLU_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True)
class Adapter:
    """The module classes of a Llama-like family, by their name prefix (LlamaRMSNorm, LlamaMLP,
    LlamaAttention, LlamaModel, LlamaForCausalLM) and the forward each switch binds to them.

    What a family's modules show (a fused qkv_proj or gate_up_proj, q_norm / k_norm per head or per
    projection, partial rotary, layers without RoPE, sliding windows per layer) the forwards read
    from the module; the fields are what no module shows:
    ``norm_casts_last``: the RMSNorm is ``(weight * normed).to(x.dtype)`` (OLMo), not
    ``weight * normed.to(x.dtype)``; ``rope_interleaved``: RoPE pairs dims (2i, 2i + 1) (GLM-4);
    ``divides_logits``: the logits are divided by config.logits_scaling (Granite);
    ``router_aux_loss``: the loss adds the routers' load-balancing loss (mixtures of experts, whose
    expert MLPs keep transformers' forward: no module of theirs is named ``{prefix}MLP``).
    """

    prefix: str
    norm_casts_last: bool = False
    rope_interleaved: bool = False
    divides_logits: bool = False
    router_aux_loss: bool = False

    def replacements(self, model) -> dict[str, dict[str, tuple]]:
        """switch -> {class name: (forward, whether it takes the switch's value)} for ``model`` (the
        transformers model, not a PEFT wrapper); "mlp" only where the config's activation is
        SwiGLU's (the caller warns otherwise)."""
        p = self.prefix
        norm = forwards.rms_norm_cast_last_forward if self.norm_casts_last else forwards.rms_norm_forward
        attention = forwards.interleaved_attention_forward if self.rope_interleaved else forwards.attention_forward
        # the model itself, when it is the causal LM, under its own forward's signature
        loss = forwards.signed_like(type(model).forward, self.divides_logits, self.router_aux_loss)
        swaps = {
            "norm": {f"{p}RMSNorm": (norm, True)},
            "rope": {f"{p}Attention": (attention, True)},
            "attention": {f"{p}Model": (forwards.base_model_forward, False)},
            "loss": {f"{p}ForCausalLM": (loss, False)},
        }
        if getattr(model.config, "hidden_act", None) in SWIGLU_ACTIVATIONS:
            swaps["mlp"] = {f"{p}MLP": (forwards.mlp_forward, True)}
        return swaps


ADAPTERS = {
    "llama": Adapter("Llama"),
    "mistral": Adapter("Mistral"),
    "qwen2": Adapter("Qwen2"),
    "qwen3": Adapter("Qwen3"),
    "granite": Adapter("Granite", divides_logits=True),
    "olmo2": Adapter("Olmo2", norm_casts_last=True),
    "olmo3": Adapter("Olmo3", norm_casts_last=True),
    "glm4": Adapter("Glm4", rope_interleaved=True),
    "smollm3": Adapter("SmolLM3"),
    "phi3": Adapter("Phi3"),
    "mixtral": Adapter("Mixtral", router_aux_loss=True),
    "qwen3_moe": Adapter("Qwen3Moe", router_aux_loss=True),
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
