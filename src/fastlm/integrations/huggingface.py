"""fastlm's kernels in a built Hugging Face transformers model: `apply_fastlm` and `revert_fastlm`.

    model = AutoModelForCausalLM.from_pretrained(...)   # or one wrapped by PEFT
    apply_fastlm(model)                                  # in place; revert_fastlm(model) undoes it

The patch is per instance: ``forward`` is rebound on the model's own modules (each keeps what it
replaced, for `revert_fastlm`), and the model's attention implementation becomes "fastlm", a
function registered in transformers' ``AttentionInterface``. Models built later, and every other
model in the process, keep transformers' code. The switches:

    attention  plain causal attention by `fastlm.flash_attention`, grouped key/value heads read in
               place; every other case (padding, packed sequences, dropout, a sliding window) by
               transformers' SDPA function, with a one-time warning (`attention_function`)
    norm       every RMSNorm (Qwen3's per-head q_norm and k_norm too) by `fastlm.rms_norm`
    rope       the rotation of queries and keys by `fastlm.rotary_embedding`, when the batch shares
               one row of positions
    mlp        silu(gate) * up by `fastlm.swiglu`, where the config's hidden_act is silu
    loss       with labels in training, the LM head and cross-entropy by
               `fastlm.linear_cross_entropy`: no logits are held and the output's logits are None

norm, rope and mlp run their kernels in eager mode; while torch.compile traces, transformers' own
PyTorch code runs there, which Inductor fuses into the kernels around it (as the fastlm model's
"auto" switches do). transformers is imported when a model is patched, not before.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
import torch.nn.functional as F

from fastlm.ops.common import DTYPES, check_flag
from fastlm.ops.flash_attention import flash_attention, flash_attention_varlen
from fastlm.ops.layer_norm import rms_norm
from fastlm.ops.linear_cross_entropy import linear_cross_entropy
from fastlm.ops.rotary import rotary_embedding
from fastlm.ops.swiglu import swiglu

# config.model_type -> the prefix of its module classes (LlamaRMSNorm, LlamaMLP, LlamaAttention,
# LlamaForCausalLM): one patch serves these families, whose modules share attribute names and forwards
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
ATTN_IMPLEMENTATION = "fastlm"
# keyword the patched base model adds to its layers' calls when it was given no attention mask: the
# attention is causal, within the packed sequences of cu_seq_lens_q/k if any, within the sliding
# window if any (`_base_model_forward`), so a mask transformers built says nothing more
PLAIN_CAUSAL = "fastlm_plain_causal"
SWIGLU_ACTIVATIONS = ("silu", "swish")

_warned_fallbacks: set[str] = set()


# ----------------------------------------------------------------------------------------------
# Attention function (transformers' AttentionInterface)
# ----------------------------------------------------------------------------------------------


def attention_function(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs
):
    """The "fastlm" attention implementation, with transformers' attention-function signature:
    query (B, H, Nq, D), key and value (B, Hkv, Nk, D) -> ((B, Nq, H, D), None).

    Causal attention runs `fastlm.flash_attention` on the grouped heads as they are, with the
    sliding window if the model has one; packed sequences (cu_seq_lens_q / cu_seq_lens_k over the
    rows laid end to end, no sequence spanning two rows) run `fastlm.flash_attention_varlen`. Every
    other case runs transformers' SDPA function, once warned per case (`_fallback_reason`): the
    result is always exact, the kernels are used where they compute the same thing.
    """
    if kwargs.pop(PLAIN_CAUSAL, False):
        # a mask transformers built anyway (it always does while torch.compile traces, to look for
        # packed sequences in the position ids) holds nothing the checks below do not see
        attention_mask = None
    reason = _fallback_reason(module, query, key, attention_mask, dropout, kwargs)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _warn_once(reason)
        if attention_mask is None:
            attention_mask = _implicit_mask(query, key, sliding_window, kwargs)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as SDPA under autocast: q, k, v in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # transformers' window: query i sees key j when i - sliding_window < j <= i
    window = None if sliding_window is None else (sliding_window - 1, 0)
    if kwargs.get("cu_seq_lens_q") is None:
        return flash_attention(query, key, value, causal=True, scale=scaling, window=window).transpose(1, 2), None
    batch, heads, length, head_dim = query.shape

    def packed(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> (B N, H, D): a view for one row
        return t.transpose(1, 2).reshape(batch * t.shape[2], t.shape[1], head_dim)

    out = flash_attention_varlen(
        packed(query),
        packed(key),
        packed(value),
        kwargs["cu_seq_lens_q"],
        kwargs["cu_seq_lens_k"],
        kwargs["max_length_q"],
        kwargs["max_length_k"],
        causal=True,
        scale=scaling,
        window=window,
    )
    return out.view(batch, length, heads, head_dim), None


def _fallback_reason(module, query, key, attention_mask, dropout, kwargs) -> str | None:
    """Why the kernels cannot compute this call, or None when they can: causal attention over the
    keys, within a sliding window if any, and within the packed sequences of cu_seq_lens_q /
    cu_seq_lens_k if given.

    The mask transformers builds for the "fastlm" implementation (`mask_function`) is None only
    where the attention is plain causal; the patched base model (`_base_model_forward`) sets it
    aside where it knows there is no padding. Dropout and non-causal attention do not show in it.
    """
    if attention_mask is not None:
        return "an attention mask (padding, or packing and windows without the patched base model)"
    packed = kwargs.get("cu_seq_lens_q") is not None
    if packed and kwargs.get("max_length_q") is None:
        return "packed sequences without max_length_q"
    if dropout > 0.0:
        return "attention dropout"
    is_causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        return "non-causal attention"
    if 1 < query.shape[2] < key.shape[2] or (packed and query.shape[2] != key.shape[2]):
        # a static cache's prefill: SDPA aligns the mask top-left
        return "more keys than queries without a mask"
    return None


def _warn_once(reason: str) -> None:
    """One warning per reason and process; none while torch.compile traces, which cannot warn."""
    if reason not in _warned_fallbacks and not torch.compiler.is_compiling():
        _warned_fallbacks.add(reason)
        warnings.warn(
            f"fastlm attention runs transformers' SDPA attention for {reason}, which "
            "fastlm.flash_attention does not cover (same result, SDPA's speed)",
            stacklevel=3,
        )


def _implicit_mask(query, key, sliding_window, kwargs) -> torch.Tensor | None:
    """The mask of what the call's arguments say but no mask carries, for SDPA: (B or 1, 1, Nq, Nk)
    bool, True where query i (at position i + Nk - Nq) sees key j: j <= i, inside the sliding
    window, in the same packed sequence (cu_seq_lens: the sequences' start offsets over the rows
    laid end to end, and the total). None when neither packing nor a window applies: SDPA's own
    arguments cover the other cases."""
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    windowed = sliding_window is not None and key.shape[2] > sliding_window
    if cu_seq_lens_q is None and not windowed:
        return None
    n_q, n_k = query.shape[2], key.shape[2]
    rows = torch.arange(n_k - n_q, n_k, device=query.device)[:, None]
    cols = torch.arange(n_k, device=key.device)[None, :]
    visible = cols <= rows
    if windowed:
        visible &= cols > rows - sliding_window
    if cu_seq_lens_q is None:
        return visible[None, None]
    first_row = torch.arange(query.shape[0], device=query.device)[:, None, None]  # each row's offset, in rows
    sequence_q = torch.searchsorted(
        cu_seq_lens_q[1:].long(), (first_row * n_q + rows - (n_k - n_q)).flatten(1), right=True
    )
    sequence_k = torch.searchsorted(cu_seq_lens_k[1:].long(), (first_row * n_k + cols).flatten(1), right=True)
    same = sequence_q.view(-1, n_q, 1) == sequence_k.view(-1, 1, n_k)  # (B, Nq, Nk)
    return (visible & same)[:, None]


def mask_function(*args, **kwargs):
    """The "fastlm" entry of transformers' AttentionMaskInterface: SDPA's mask, or None where that
    is plain causal attention over all keys. transformers returns None there itself, except where it
    builds the mask to look for packed sequences and keeps it (transformers 4, and 5 while
    torch.compile traces). The comparison reads the mask, so tracing keeps it: SDPA then runs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    if mask is None or torch.compiler.is_compiling() or mask.shape[-1] != mask.shape[-2]:
        return mask
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    return None if torch.equal(mask, causal.expand_as(mask)) else mask


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_function)
    # transformers builds an implementation's mask with the function registered under its name; one
    # with no entry gets no mask at all, padding and packing included
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)


# ----------------------------------------------------------------------------------------------
# Module forwards, bound to the patched instances
# ----------------------------------------------------------------------------------------------


def _base_model_forward(self, *args, **kwargs):
    """The base model (LlamaModel, ...), its attention calls told what their mask is when it was
    given no attention mask (`PLAIN_CAUSAL`): causal, within any sliding window, and within the
    packed sequences that restarting position ids mark, handed on as cu_seq_lens_q/k as
    `DataCollatorWithFlattening` hands them (`_packed_sequences`). Lets the kernels run where
    transformers builds a mask only reading its data could show to be causal (packing, and every
    call while torch.compile traces)."""
    if len(args) > 1 or kwargs.get("attention_mask") is not None:
        return _original_forward(self, *args, **kwargs)
    positions = kwargs.get("position_ids")
    if positions is not None and kwargs.get("cu_seq_lens_q") is None:
        if torch.compiler.is_compiling() or not _looks_for_packing(self, kwargs):
            return _original_forward(self, *args, **kwargs)  # transformers' mask says what positions mean
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        kwargs.update(_packed_sequences(positions, positions.shape[0] if inputs is None else inputs.shape[0]))
    kwargs[PLAIN_CAUSAL] = True
    return _original_forward(self, *args, **kwargs)


def _looks_for_packing(model, kwargs) -> bool:
    """Whether transformers reads packed sequences from the position ids of this call: only without
    a cache (Trainer's use_cache=False), as `create_causal_mask` does."""
    use_cache = kwargs.get("use_cache")
    use_cache = model.config.use_cache if use_cache is None else use_cache
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    return cache is None and not use_cache


def _packed_sequences(position_ids: torch.Tensor, batch: int) -> dict:
    """cu_seq_lens_q/k and max_length_q/k of the packed sequences of ``batch`` rows of position ids
    (1 or batch, N): a sequence starts at each row's first token and where a position is not its
    predecessor's + 1, and never spans two rows (transformers' rule); {} where every row is one
    sequence. Reads the positions: one wait for the GPU per forward, in eager mode only."""
    positions = position_ids.expand(batch, -1)
    starts = positions[:, 1:] - positions[:, :-1] != 1  # (B, N - 1)
    if not starts.any():
        return {}
    first = torch.ones(batch, 1, dtype=torch.bool, device=positions.device)
    edges = [*torch.nonzero(torch.cat((first, starts), dim=1).flatten()).flatten().tolist(), positions.numel()]
    offsets = torch.tensor(edges, dtype=torch.int32, device=positions.device)
    longest = max(b - a for a, b in zip(edges, edges[1:], strict=False))
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def _original_forward(module, *args, **kwargs):
    """Call the forward that `_rebind` replaced on ``module``."""
    original = module._fastlm_original
    if original is None:
        return type(module).forward(module, *args, **kwargs)
    return original(*args, **kwargs)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm, ``weight * normed.to(input dtype)``, as one kernel: the result has the
    same dtype (the promotion of the input's and the weight's), rounded once instead of twice.
    Under autocast it is written in the autocast dtype, which the Linear (or the attention) it
    feeds casts it to anyway: that saves a full-width fp32 write and a cast pass."""
    if torch.compiler.is_compiling():
        return _original_forward(self, hidden_states)
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        out_dtype = torch.get_autocast_dtype(device)
    else:
        out_dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, out_dtype=out_dtype)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _original_forward(self, x)
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The families' attention forward with the rotation by `fastlm.rotary_embedding`.

    The kernel takes one (N, D/2) table of angles for every row of the batch, so it runs when
    transformers' cos and sin are (1, N, D): position_ids (1, N), the default and what packed
    sequences use, whatever positions they hold. Per-row positions (batched generation with left
    padding) and torch.compile take the original forward.
    """
    cos, sin = position_embeddings
    if cos.dim() != 3 or cos.shape[0] != 1 or torch.compiler.is_compiling():
        return _original_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    input_shape = hidden_states.shape[:-1]
    heads_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(heads_shape)  # (B, N, H, D)
    key = self.k_proj(hidden_states).view(heads_shape)  # (B, N, Hkv, D)
    value = self.v_proj(hidden_states).view(heads_shape).transpose(1, 2)  # (B, Hkv, N, D)
    if hasattr(self, "q_norm"):  # Qwen3 normalizes each head before the rotation
        query, key = self.q_norm(query), self.k_norm(key)
    # transformers' tables hold each position's D/2 angles twice (cat(freqs, freqs)); row n is token n's
    half = self.head_dim // 2
    query, key = rotary_embedding(
        query.transpose(1, 2), key.transpose(1, 2), cos[0, :, :half].float(), sin[0, :, :half].float()
    )
    cache, past_key_values = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)  # 5.x / 4.x name
    cache = past_key_values if cache is None else cache
    cache_position = kwargs.pop("cache_position", None)
    if cache is not None:
        # transformers 4 reads a fourth argument, cache_kwargs (static caches need cache_position); 5 ignores it
        cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
        key, value = cache.update(key, value, self.layer_idx, cache_kwargs)
    interface = _attention_interface(self)
    output, weights = interface(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)),
        **kwargs,
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _attention_interface(module):
    """The attention function the model's config names, as the families' forward looks it up."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get(module.config._attn_implementation, eager)


def _causal_lm_forward(self, *args, **kwargs):
    """With labels in training, the base model and then `causal_lm_loss` on its last hidden states:
    the logits are never formed, and the output's are None. Otherwise (no labels, evaluation,
    ``logits_to_keep``, an lm_head that is not a plain Linear, e.g. one with a PEFT adapter or
    quantized) the original forward, so generate(), metrics and adapters see the same outputs."""
    keep = kwargs.get("logits_to_keep", 0)
    fused = kwargs.get("labels") is not None and self.training and type(self.lm_head) is torch.nn.Linear
    if not (fused and isinstance(keep, int) and keep == 0):
        return _original_forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    outputs = getattr(self, self.base_model_prefix)(*args, **kwargs)
    loss = causal_lm_loss(
        outputs.last_hidden_state,
        self.lm_head,
        labels,
        kwargs.get("num_items_in_batch"),
        kwargs.get("ignore_index", -100),
        kwargs.get("shift_labels"),
    )
    fields = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    output = CausalLMOutputWithPast(loss=loss, **fields)
    return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def causal_lm_loss(hidden, lm_head, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None):
    """transformers' ForCausalLMLoss of ``lm_head(hidden)`` by `fastlm.linear_cross_entropy`.

    hidden (B, N, d); labels (B, N), shifted here so that token t predicts label t + 1 (the last
    token predicts nothing), or ``shift_labels`` (B, N) already shifted. The mean over labels that
    are not ``ignore_index``, or with ``num_items_in_batch`` (Trainer's count over the accumulated
    micro-batches) the sum divided by it.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    rows = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(rows, lm_head.weight, targets, lm_head.bias, ignore_index=ignore_index)
    total = linear_cross_entropy(
        rows, lm_head.weight, targets, lm_head.bias, ignore_index=ignore_index, reduction="sum"
    )
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _signed_like(forward):
    """`_causal_lm_forward` under the signature of the ``forward`` it replaces: Trainer reads that
    signature for the dataset columns to keep and for whether to pass num_items_in_batch."""

    @functools.wraps(forward)
    def signed(self, *args, **kwargs):
        return _causal_lm_forward(self, *args, **kwargs)

    return signed


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def apply_fastlm(
    model, *, attention: bool = True, norm: bool = True, rope: bool = True, mlp: bool = True, loss: bool = True
):
    """Run ``model``'s attention, RMSNorms, RoPE, SwiGLU MLPs and training loss through fastlm's
    kernels (module docstring), in place; returns ``model``.

    ``model``: a built transformers model of a family in `FAMILIES` (config.model_type), usually a
    ...ForCausalLM, or a PEFT model wrapping one. An unsupported model raises ValueError and is
    left as it was. Applying again first reverts the earlier patch, so the switches given last
    are the ones in force.
    """
    switches = {"attention": attention, "norm": norm, "rope": rope, "mlp": mlp, "loss": loss}
    attention, norm, rope, mlp, loss = (check_flag(name, value) for name, value in switches.items())
    base = _unwrap(model)
    prefix = _family_prefix(base)
    _check_dtypes(base)
    revert_fastlm(base)
    replacements = {}
    if norm:
        replacements[f"{prefix}RMSNorm"] = _rms_norm_forward
    if rope:
        replacements[f"{prefix}Attention"] = _attention_forward
    if mlp:
        if getattr(base.config, "hidden_act", None) in SWIGLU_ACTIVATIONS:
            replacements[f"{prefix}MLP"] = _mlp_forward
        else:
            warnings.warn(
                f"apply_fastlm leaves the MLPs as they are: hidden_act {base.config.hidden_act!r} is not SwiGLU's silu",
                stacklevel=2,
            )
    if attention:
        replacements[f"{prefix}Model"] = _base_model_forward
    if loss:  # the model itself, when it is the causal LM
        replacements[f"{prefix}ForCausalLM"] = _signed_like(type(base).forward)
    for module in base.modules():
        name = next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in replacements), None)
        if name is not None:
            _rebind(module, replacements[name])
    if attention:
        _register_attention()
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
    one (None: the class's), is kept for `_original_forward` and `revert_fastlm`. Both are
    attributes of the instance, so a deep copy of a patched model is patched in the same way."""
    module._fastlm_original = module.__dict__.get("forward")
    module.forward = types.MethodType(replacement, module)


def _unwrap(model):
    """The transformers model inside a PEFT wrapper (its get_base_model()), else ``model``."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _family_prefix(model) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"apply_fastlm supports the transformers model types {', '.join(FAMILIES)}; got "
            f"{type(model).__name__} with model_type {model_type!r}"
        )
    return FAMILIES[model_type]
