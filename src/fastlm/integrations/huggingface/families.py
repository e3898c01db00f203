"""Which transformers modules of each model family get which forward: one small adapter per family,
keyed by ``config.model_type``. A family whose modules share Llama's attribute names and forwards
(input_layernorm, q_proj ... o_proj, gate_proj / up_proj / down_proj, model.layers, lm_head) is one
line: its class-name prefix, with a field for each way its math differs where no module shows it."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.integrations.huggingface import forwards

# transformers' activation names (config.hidden_act / hidden_activation) -> the MLP forward that
# fuses the gating: exactly the activations whose PyTorch math the kernels compute (gelu_new and
# the other GELU variants compute the same function by other formulas, and keep their MLPs)
MLP_FORWARDS = {
    "silu": forwards.mlp_forward,
    "swish": forwards.mlp_forward,
    "gelu_pytorch_tanh": forwards.gelu_tanh_mlp_forward,
    "gelu": forwards.gelu_mlp_forward,
}
# the same for the experts of a mixture of experts (`forwards.experts_forward`)
EXPERTS_FORWARDS = {
    "silu": forwards.experts_forward,
    "swish": forwards.experts_forward,
    "gelu_pytorch_tanh": forwards.gelu_tanh_experts_forward,
    "gelu": forwards.gelu_experts_forward,
}


@dataclass(frozen=True)
class Adapter:
    """The module classes of a Llama-like family, by their name prefix (LlamaRMSNorm, LlamaMLP,
    LlamaAttention, LlamaModel, LlamaForCausalLM) and the forward each switch binds to them.

    What a family's modules show (a fused qkv_proj or gate_up_proj, q_norm / k_norm per head or per
    projection, partial rotary, layers without RoPE, sliding windows per layer, RoPE tables per
    layer type) the forwards read from the module; the fields are what no module shows:
    ``norm_casts_last``: the RMSNorm is ``(weight * normed).to(x.dtype)`` (OLMo), not
    ``weight * normed.to(x.dtype)``; ``norm_adds_one``: it is ``(normed * (1 + weight)).to(x.dtype)``
    (Gemma); ``rope_interleaved``: RoPE pairs dims (2i, 2i + 1) (GLM-4);
    ``divides_logits``: the logits are divided by config.logits_scaling (Granite);
    ``router_aux_loss``: the loss adds the routers' load-balancing loss (mixtures of experts, whose
    ``{prefix}Experts`` take the mlp switch's forward);
    ``softcaps``: the attention hands config.attn_logit_softcapping to the attention function
    (Gemma 2), which fastlm's softcaps in the kernel;
    ``softcaps_logits``: the LM head's logits are softcapped by config.final_logit_softcapping where
    it is set (Gemma 2 and 3), which the fused loss applies too; ``activation``: the config field the MLP
    reads its activation from; ``base_model``: the base model's class where it is not
    ``{prefix}Model`` (Gemma 3's text model).
    """

    prefix: str
    norm_casts_last: bool = False
    norm_adds_one: bool = False
    rope_interleaved: bool = False
    divides_logits: bool = False
    router_aux_loss: bool = False
    softcaps: bool = False
    softcaps_logits: bool = False
    activation: str = "hidden_act"
    base_model: str | None = None

    def replacements(self, model) -> dict[str, dict[str, tuple]]:
        """switch -> {class name: (forward, whether it takes the switch's value)} for ``model`` (the
        transformers model, not a PEFT wrapper), without the switches `kept` names."""
        p = self.prefix
        if self.norm_adds_one:
            norm = forwards.one_plus_weight_rms_norm_forward
        else:
            norm = forwards.rms_norm_cast_last_forward if self.norm_casts_last else forwards.rms_norm_forward
        if self.softcaps:
            attention = forwards.softcapped_attention_forward
        else:
            attention = forwards.interleaved_attention_forward if self.rope_interleaved else forwards.attention_forward
        # the model itself, when it is the causal LM, under its own forward's signature
        loss = forwards.signed_like(
            type(model).forward, self.divides_logits, self.router_aux_loss, self.softcaps_logits
        )
        swaps = {
            "norm": {f"{p}RMSNorm": (norm, True)},
            "rope": {f"{p}Attention": (attention, True)},
            "attention": {self.base_model or f"{p}Model": (forwards.base_model_forward, False)},
            "loss": {f"{p}ForCausalLM": (loss, False)},
            "mlp": {
                f"{p}MLP": (MLP_FORWARDS.get(self._activation(model)), True),
                f"{p}Experts": (EXPERTS_FORWARDS.get(self._activation(model)), True),
            },
        }
        return {switch: classes for switch, classes in swaps.items() if switch not in self.kept(model)}

    def kept(self, model) -> dict[str, str]:
        """switch -> why it keeps transformers' code for ``model``: what its kernels would compute
        differently (`apply_fastlm` warns once for each, when the patch is applied)."""
        config = model.config
        kept = {}
        activation = self._activation(model)
        if activation not in MLP_FORWARDS:
            fused = ", ".join(MLP_FORWARDS)
            kept["mlp"] = f"the MLPs as they are: {self.activation} {activation!r} is not one fastlm fuses ({fused})"
        if getattr(config, "use_bidirectional_attention", False):
            kept["attention"] = "the attention as it is: use_bidirectional_attention is not causal attention"
        return kept

    def _activation(self, model) -> str | None:
        return getattr(model.config, self.activation, None)


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
    "gemma": Adapter("Gemma", norm_adds_one=True),
    "gemma2": Adapter(
        "Gemma2", norm_adds_one=True, softcaps=True, softcaps_logits=True, activation="hidden_activation"
    ),
    "gemma3_text": Adapter(
        "Gemma3",
        norm_adds_one=True,
        softcaps_logits=True,
        activation="hidden_activation",
        base_model="Gemma3TextModel",
    ),
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
