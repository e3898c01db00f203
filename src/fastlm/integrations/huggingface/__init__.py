"""fastlm's kernels in a built Hugging Face transformers model: `apply_fastlm` and `revert_fastlm`.

    model = AutoModelForCausalLM.from_pretrained(...)   # or one wrapped by PEFT
    apply_fastlm(model)                                  # in place; revert_fastlm(model) undoes it

The patch is per instance: ``forward`` is rebound on the model's own modules (each keeps what it
replaced, for `revert_fastlm`), and the model's attention implementation becomes "fastlm", a
function registered in transformers' ``AttentionInterface`` (attention.py). Models built later, and
every other model in the process, keep transformers' code. Which modules of a family get which
forward (forwards.py) is the family's adapter (families.py). The switches, named as the fields of
`fastlm.settings.Kernels`:

    attention  causal attention by `fastlm.flash_attention`, grouped key/value heads read in place;
               packed sequences and right- or left-padded batches (each row's real tokens) by
               `fastlm.flash_attention_varlen`; every other case (a mask with holes, dropout,
               non-causal attention) by transformers' SDPA function, with a one-time warning
               (`attention_function`)
    norm       every RMSNorm (q_norm and k_norm, per head or per projection, too; Gemma's
               (1 + weight) ones) by `fastlm.rms_norm`
    rope       the rotation of queries and keys by `fastlm.rotary_embedding`, when the batch shares
               one row of positions (partial and interleaved rotary too)
    mlp        act(gate) * up by `fastlm.swiglu` (silu) or `fastlm.geglu` (gelu, gelu_pytorch_tanh)
               in the dense MLPs; a mixture of experts' experts by `fastlm.ops.moe.moe_experts`
               (the gating fused into grouped GEMMs; Mixtral, Qwen3-MoE)
    loss       with labels in training, the LM head and cross-entropy by
               `fastlm.linear_cross_entropy`: no logits are held and the output's logits are None

What a switch cannot compute exactly for a model (another activation, Gemma 2's softcapped
attention scores or logits, bidirectional attention) keeps transformers' code, with one warning
when the patch is applied (`Adapter.kept`): a patched model is always the same model.

True for norm, rope and mlp is "auto": their kernels run in eager mode, and while torch.compile
traces transformers' own PyTorch code runs there, which Inductor fuses into the kernels around it
(the layers' rule, `fastlm.layers.rules`); "fastlm" runs the kernels under torch.compile too. A
mixture of experts' experts run the kernels under torch.compile unless mlp is "torch": Inductor
has no fusion of its own for them.
transformers is imported when a model is patched, not before.

Without the patch, `register_experts` adds "fastlm" to transformers' experts implementations
(experts.py): ``from_pretrained(..., experts_implementation="fastlm")`` runs a mixture of experts'
experts by `fastlm.ops.moe.moe_experts` and leaves the rest of the model as it is.
"""

from __future__ import annotations

import types
import warnings

from fastlm.integrations.huggingface.attention import (
    ATTN_IMPLEMENTATION,
    attention_function,
    mask_function,
    register_attention,
)
from fastlm.integrations.huggingface.experts import register_experts
from fastlm.integrations.huggingface.families import FAMILIES, adapter_for
from fastlm.integrations.huggingface.forwards import causal_lm_loss
from fastlm.integrations.huggingface.fp8 import fp8_layers
from fastlm.layers.fp8 import fp8_linear_forward
from fastlm.ops.common import DTYPES
from fastlm.settings import FUSED_CHOICES, SWITCHES, Kernels

__all__ = [
    "FAMILIES",
    "apply_fastlm",
    "attention_function",
    "causal_lm_loss",
    "mask_function",
    "register_experts",
    "revert_fastlm",
]
# what True means for each switch of apply_fastlm: the fastlm kernel set's value
SWITCH_DEFAULTS = {name: getattr(Kernels.named("fastlm"), name) for name in SWITCHES if name != "softmax"}


def apply_fastlm(
    model,
    *,
    attention: bool = True,
    norm: bool | str = True,
    rope: bool | str = True,
    mlp: bool | str = True,
    loss: bool = True,
    fp8: bool = False,
):
    """Run ``model``'s attention, RMSNorms, RoPE, gated MLPs and training loss through fastlm's
    kernels (module docstring), in place; returns ``model``. ``fp8``: the linear layers of the
    decoder through `fastlm.fp8_linear` too (`fp8.fp8_layers` says which).

    ``model``: a built transformers model of a family in `FAMILIES` (config.model_type), usually a
    ...ForCausalLM, or a PEFT model wrapping one. An unsupported model raises ValueError and is
    left as it was. Applying again first reverts the earlier patch, so the switches given last
    are the ones in force. Each switch is True (the fastlm kernel set's value), False, or for
    norm, rope and mlp a `fastlm.settings.Kernels` value: "auto" (True), "fastlm" or "torch" (False).
    """
    given = {"attention": attention, "norm": norm, "rope": rope, "mlp": mlp, "loss": loss}
    values = {name: _switch(name, value) for name, value in given.items()}
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be True or False, got {fp8!r}")
    base = _unwrap(model)
    adapter = adapter_for(base)
    _check_dtypes(base)
    revert_fastlm(base)
    swaps = adapter.replacements(base)
    for switch, what in adapter.kept(base).items():
        if values[switch] is not None:
            warnings.warn(f"apply_fastlm leaves {what}", stacklevel=2)
    replacements = {
        name: _with_switch(forward, values[switch]) if takes_switch else forward
        for switch, classes in swaps.items()
        if values[switch] is not None
        for name, (forward, takes_switch) in classes.items()
    }
    for module in base.modules():
        name = next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in replacements), None)
        if name is not None:
            _rebind(module, replacements[name])
    if fp8:
        for module in fp8_layers(base):
            _rebind(module, fp8_linear_forward)
    if values["attention"] is not None and "attention" in swaps:
        register_attention()
        base._fastlm_attn_implementation = base.config._attn_implementation
        base.config._attn_implementation = ATTN_IMPLEMENTATION
    return model


def _check_dtypes(model) -> None:
    """ValueError, before anything is patched, for floating-point weights the kernels do not take."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} - set(DTYPES)
    if dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        takes = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"apply_fastlm needs weights of {takes} (its kernels take no other), got {names}")


def revert_fastlm(model):
    """Undo `apply_fastlm` on ``model`` (or the PEFT model wrapping it): the original forwards and
    attention implementation come back. A model that is not patched is returned as it is."""
    base = _unwrap(model)
    for module in base.modules():
        if "_fastlm_original" in module.__dict__:
            original = module.__dict__.pop("_fastlm_original")
            if original is None:
                del module.forward  # the class's forward shows through again
            else:
                module.forward = original
    if "_fastlm_attn_implementation" in base.__dict__:
        base.config._attn_implementation = base.__dict__.pop("_fastlm_attn_implementation")
    return model


def _rebind(module, replacement) -> None:
    """``module.forward`` becomes ``replacement`` bound to it; the instance's own forward, if it had
    one (None: the class's), is kept for `original_forward` and `revert_fastlm`. Both are
    attributes of the instance, so a deep copy of a patched model is patched in the same way."""
    module._fastlm_original = module.__dict__.get("forward")
    module.forward = types.MethodType(replacement, module)


def _with_switch(forward, switch: str):
    """``forward`` with its ``switch`` keyword given: a plain function (a method of a partial object
    breaks torch.compile's graph in torch 2.11)."""

    def bound(self, *args, **kwargs):
        return forward(self, *args, switch=switch, **kwargs)

    return bound


def _switch(name: str, value) -> str | None:
    """The Kernels value a switch of `apply_fastlm` stands for (None: off), or TypeError / ValueError."""
    if value is True:
        return SWITCH_DEFAULTS[name]
    if value is False or value == "torch":
        return None
    if isinstance(value, str) and SWITCH_DEFAULTS[name] == "auto" and value in FUSED_CHOICES:
        return value
    takes = "True or False" if SWITCH_DEFAULTS[name] != "auto" else "True, False, 'auto', 'fastlm' or 'torch'"
    raise TypeError(f"{name} must be {takes}, got {value!r}")


def _unwrap(model):
    """The transformers model inside a PEFT wrapper (its get_base_model()), else ``model``."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
