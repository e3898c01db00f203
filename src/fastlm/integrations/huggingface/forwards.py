"""The forwards `apply_fastlm` binds to a patched model's own modules, each running a fastlm layer's
path where the layers' rule runs its kernel and the forward it replaced everywhere else.

``switch`` (bound per module when the patch is applied) is the `fastlm.settings.Kernels` value of
the module's switch: "auto" (the kernel in eager mode, transformers' PyTorch code while
torch.compile traces, which Inductor fuses into the kernels around it) or "fastlm" (always).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from fastlm.integrations.huggingface.attention import ATTN_IMPLEMENTATION, PADDING, PLAIN_CAUSAL, Padding
from fastlm.integrations.huggingface.experts import layout_fits
from fastlm.layers.loss import lm_head_loss
from fastlm.layers.mlp import gated_activation
from fastlm.layers.moe import experts_output
from fastlm.layers.norms import fused_rms_norm
from fastlm.layers.rotary import rotate
from fastlm.layers.rules import runs_kernel


def base_model_forward(self, *args, **kwargs):
    """The base model (LlamaModel, ...), its attention calls told what their mask is when it was
    given no attention mask (`PLAIN_CAUSAL`): causal, within any sliding window, and within the
    packed sequences that restarting position ids mark, handed on as cu_seq_lens_q/k as
    `DataCollatorWithFlattening` hands them (`_packed_sequences`). Lets the kernels run where
    transformers builds a mask only reading its data could show to be causal (packing, and every
    call while torch.compile traces).

    Given a 2-D attention mask of right or left padding and no cache, the layers get the batch's
    `Padding` instead (`_padding`), read once here for all of them, and transformers builds no
    (B, 1, N, N) mask: each row's real tokens are one sequence for the varlen kernel. Every other
    mask (holes, 4-D, with a cache, while torch.compile traces) is transformers' to build.
    """
    if len(args) > 1:
        return original_forward(self, *args, **kwargs)
    if kwargs.get("attention_mask") is not None:
        padding = _padding(self, kwargs, _inputs(args, kwargs))
        if padding is None:
            return original_forward(self, *args, **kwargs)
        # position_ids stay as given: transformers' are arange(N) for every row whatever the mask
        kwargs.update({"attention_mask": None, PADDING: padding, PLAIN_CAUSAL: True})
        return original_forward(self, *args, **kwargs)
    positions = kwargs.get("position_ids")
    if positions is not None and kwargs.get("cu_seq_lens_q") is None:
        if torch.compiler.is_compiling() or not _looks_for_packing(self, kwargs):
            return original_forward(self, *args, **kwargs)  # transformers' mask says what positions mean
        inputs = _inputs(args, kwargs)
        kwargs.update(_packed_sequences(positions, positions.shape[0] if inputs is None else inputs.shape[0]))
    kwargs[PLAIN_CAUSAL] = True
    return original_forward(self, *args, **kwargs)


def _inputs(args, kwargs) -> torch.Tensor | None:
    """The call's input_ids (B, N) or inputs_embeds (B, N, d), whichever it was given."""
    if args:
        return args[0]
    return kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")


def _padding(model, kwargs, inputs) -> Padding | None:
    """The `Padding` of this call's 2-D attention mask (B, N), or None where transformers' own mask
    is what attention must see: a model made bidirectional (config.is_causal False), under
    torch.compile (the reading below branches on the mask's values, which a trace cannot), with a
    cache passed in (generation: the keys reach beyond this call's tokens), a mask that is not a
    (B, N) tensor for the inputs (4-D, or a dict of masks per layer type), one given with
    cu_seq_lens, one without padding (transformers drops an all-ones mask itself) or with holes (a
    row whose real tokens are not contiguous: SDPA runs, with a warning).

    Reads the mask: one wait for the GPU per forward, in eager mode only (the .tolist() below; the
    indices then come from nonzero_static, whose size is known, without a second one).
    """
    mask = kwargs["attention_mask"]
    cache_given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if torch.compiler.is_compiling() or cache_given or kwargs.get("cu_seq_lens_q") is not None:
        return None
    if not getattr(model.config, "is_causal", True):
        return None
    if inputs is None or not torch.is_tensor(mask) or tuple(mask.shape) != tuple(inputs.shape[:2]):
        return None
    real = mask.to(device=inputs.device, dtype=torch.bool)  # (B, N), as transformers reads it
    lengths = real.sum(dim=1)  # (B,)
    runs = (real & ~F.pad(real[:, :-1], (1, 0))).sum(dim=1)  # (B,) runs of real tokens: 1 (0 if none)
    total, longest, holes = torch.stack((lengths.sum(), lengths.max(), (runs > 1).sum())).tolist()
    if holes or total in (0, real.numel()):
        return None
    rows, positions = torch.nonzero_static(real, size=total).unbind(dim=1)  # (T,) each, row-major
    cu_seqlens = F.pad(lengths.cumsum(dim=0), (1, 0)).to(torch.int32)  # (B + 1,)
    return Padding(real, rows, positions, cu_seqlens, longest)


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


def original_forward(module, *args, **kwargs):
    """Call the forward that `_rebind` replaced on ``module``."""
    original = module._fastlm_original
    if original is None:
        return type(module).forward(module, *args, **kwargs)
    return original(*args, **kwargs)


def rms_norm_forward(self, hidden_states: torch.Tensor, *, switch: str) -> torch.Tensor:
    """transformers' RMSNorm, ``weight * normed.to(input dtype)``, as one kernel where the layers'
    rule runs it (`fused_rms_norm`: the same dtype, the promotion of the input's and the weight's,
    rounded once instead of twice; under autocast the autocast dtype, which the Linear or the
    attention it feeds casts to anyway); transformers' own forward where it does not."""
    if not runs_kernel(switch):
        return original_forward(self, hidden_states)
    return fused_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def rms_norm_cast_last_forward(self, hidden_states: torch.Tensor, *, switch: str) -> torch.Tensor:
    """OLMo's RMSNorm, ``(weight * normed).to(input dtype)``, as one kernel where the layers' rule
    runs it: the input's dtype (under autocast the autocast dtype), rounded once as OLMo rounds it."""
    if not runs_kernel(switch):
        return original_forward(self, hidden_states)
    return fused_rms_norm(hidden_states, self.weight, self.variance_epsilon, promote=False)


def one_plus_weight_rms_norm_forward(self, hidden_states: torch.Tensor, *, switch: str) -> torch.Tensor:
    """Gemma's RMSNorm, ``(normed * (1 + weight.float())).type_as(x)`` in fp32, as one kernel where
    the layers' rule runs it: the 1 is added to the weight inside the kernel (the weight's gradient
    is the same), and the output is the input's dtype (under autocast the autocast dtype), rounded
    once as Gemma rounds it."""
    if not runs_kernel(switch):
        return original_forward(self, hidden_states)
    return fused_rms_norm(hidden_states, self.weight, self.eps, promote=False, weight_offset=1.0)


def mlp_forward(self, x: torch.Tensor, *, switch: str, activation: str = "silu") -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with the gating by `fastlm.swiglu` (``activation`` "silu") or
    `fastlm.geglu` ("gelu_tanh", "gelu") where the rule runs it; gate and up are the two halves of
    one gate_up_proj where the module has one (Phi-3, GLM-4), which the kernels read in place."""
    if not runs_kernel(switch):
        return original_forward(self, x)
    if hasattr(self, "gate_up_proj"):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(gated_activation(gate, up, activation, switch))


def gelu_tanh_mlp_forward(self, x: torch.Tensor, *, switch: str) -> torch.Tensor:
    """`mlp_forward` with GELU's tanh form (transformers' gelu_pytorch_tanh: Gemma)."""
    return mlp_forward(self, x, switch=switch, activation="gelu_tanh")


def gelu_mlp_forward(self, x: torch.Tensor, *, switch: str) -> torch.Tensor:
    """`mlp_forward` with the exact GELU (transformers' gelu)."""
    return mlp_forward(self, x, switch=switch, activation="gelu")


def experts_forward(self, hidden_states, top_k_index, top_k_weights, *, switch: str, activation: str = "silu"):
    """A mixture of experts' experts (gate_up_proj (E, 2I, D), down_proj (E, D, I); Mixtral,
    Qwen3-MoE) by `fastlm.ops.moe.moe_experts` unless the switch is "torch": the tokens sorted by expert,
    the gated MLPs as grouped GEMMs, the K outputs summed per token; a pair whose expert is outside
    [0, E) (another process's, under expert parallelism) adds nothing, as the loop skips it. Experts
    with biases, or their weights transposed or interleaved, keep their forward."""
    # the experts' kernels run under torch.compile as well, unless the switch is "torch": Inductor
    # has no fusion of its own for a loop over the experts or grouped_mm
    if switch == "torch" or not layout_fits(self):
        return original_forward(self, hidden_states, top_k_index, top_k_weights)
    return experts_output(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, activation)


def gelu_tanh_experts_forward(self, hidden_states, top_k_index, top_k_weights, *, switch: str):
    """`experts_forward` with GELU's tanh form (transformers' gelu_pytorch_tanh)."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, switch=switch, activation="gelu_tanh")


def gelu_experts_forward(self, hidden_states, top_k_index, top_k_weights, *, switch: str):
    """`experts_forward` with the exact GELU (transformers' gelu)."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights, switch=switch, activation="gelu")


def attention_forward(
    self,
    hidden_states,
    position_embeddings=None,
    attention_mask=None,
    *,
    switch: str,
    interleaved=False,
    softcap=None,
    **kwargs,
):
    """The families' attention forward with the rotation by `fastlm.rotary_embedding`.

    The kernel takes one (N, R/2) table of angles for every row of the batch, so it runs when
    transformers' cos and sin are (1, N, R): position_ids (1, N), the default and what packed
    sequences use, whatever positions they hold. Per-row positions (batched generation with left
    padding), torch.compile and a layer without RoPE (SmolLM3's ``use_rope`` 0) take the original
    forward. What the families differ in is read from the module: one fused qkv_proj (Phi-3),
    q_norm / k_norm over each head (Qwen3) or over the whole projection (OLMo 2 and 3), the
    rotation of the first R of each head's D dims (partial rotary: R is the tables' width).
    ``interleaved``: the rotation pairs dims (2i, 2i + 1) (GLM-4), not (i, i + R/2). ``softcap``:
    handed to the attention function as the family's forward hands it (Gemma 2's
    attn_logit_softcapping, which the "fastlm" implementation softcaps in the kernel).
    """
    cos, sin = position_embeddings
    if cos.dim() != 3 or cos.shape[0] != 1 or torch.compiler.is_compiling() or not getattr(self, "use_rope", True):
        return original_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    input_shape = hidden_states.shape[:-1]
    heads_shape = (*input_shape, -1, self.head_dim)
    query, key, value = _projections(self, hidden_states)  # (B, N, H D), (B, N, Hkv D), (B, N, Hkv D)
    norms = getattr(self, "q_norm", None) is not None
    per_head = norms and self.q_norm.weight.shape[-1] == self.head_dim
    if norms and not per_head:  # OLMo normalizes the whole projection
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = query.view(heads_shape), key.view(heads_shape)  # (B, N, H, D), (B, N, Hkv, D)
    value = value.view(heads_shape).transpose(1, 2)  # (B, Hkv, N, D)
    if per_head:  # Qwen3 normalizes each head before the rotation
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = _rotate(query.transpose(1, 2), key.transpose(1, 2), cos[0], sin[0], switch, interleaved)
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
        **({} if softcap is None else {"softcap": softcap}),
        **kwargs,
    )
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def interleaved_attention_forward(self, *args, switch: str, **kwargs):
    """`attention_forward` rotating pairs of neighbouring dims (GLM-4's RoPE)."""
    return attention_forward(self, *args, switch=switch, interleaved=True, **kwargs)


def softcapped_attention_forward(self, *args, switch: str, **kwargs):
    """`attention_forward` handing the module's attn_logit_softcapping to the attention function,
    as Gemma 2's forward does."""
    return attention_forward(self, *args, switch=switch, softcap=self.attn_logit_softcapping, **kwargs)


def _projections(module, hidden_states):
    """The queries (B, N, H D), keys and values (B, N, Hkv D): three projections, or the three parts
    of one (Phi-3's qkv_proj, queries first)."""
    if not hasattr(module, "qkv_proj"):
        return module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)
    config = module.config
    kv = config.num_key_value_heads * module.head_dim
    return module.qkv_proj(hidden_states).split((config.num_attention_heads * module.head_dim, kv, kv), dim=-1)


def _rotate(query, key, cos, sin, switch: str, interleaved: bool):
    """query (B, H, N, D) and key (B, Hkv, N, D) with their first R dims rotated by transformers'
    (N, R) tables, which hold each position's R/2 angles twice (cat(freqs, freqs)); R < D is partial
    rotary, the other D - R dims pass as they are. ``interleaved`` pairs (2i, 2i + 1) share angle i:
    the kernel's pairs (i, i + R/2) after a permutation of the R dims (a copy each way)."""
    rotary = cos.shape[-1]
    half = rotary // 2
    q_rot, k_rot = query[..., :rotary], key[..., :rotary]
    if interleaved:
        q_rot, k_rot = _halves_from_pairs(q_rot), _halves_from_pairs(k_rot)
    q_rot, k_rot = rotate(q_rot, k_rot, cos[:, :half], sin[:, :half], switch)
    if interleaved:
        q_rot, k_rot = _pairs_from_halves(q_rot), _pairs_from_halves(k_rot)
    if rotary == query.shape[-1]:
        return q_rot, k_rot
    return torch.cat((q_rot, query[..., rotary:]), dim=-1), torch.cat((k_rot, key[..., rotary:]), dim=-1)


def _halves_from_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., R) with pairs (x_2i, x_2i+1) -> (x_0, x_2, ..., x_1, x_3, ...): pairs (i, i + R/2)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _pairs_from_halves(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `_halves_from_pairs`."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _attention_interface(module):
    """The attention function the model's config names, as the families' forward looks it up."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get(module.config._attn_implementation, eager)


def causal_lm_forward(
    self, args, kwargs, divides_logits: bool = False, router_aux_loss: bool = False, softcaps_logits: bool = False
):
    """With labels in training, the base model and then `causal_lm_loss` on its last hidden states:
    the logits are never formed, and the output's are None. Otherwise (no labels, evaluation,
    ``logits_to_keep``, an lm_head that is not a plain Linear, e.g. one with a PEFT adapter or
    quantized) the original forward, so generate(), metrics and adapters see the same outputs.

    ``divides_logits``: the logits are lm_head(hidden) / config.logits_scaling (Granite); for a head
    without bias that is lm_head(hidden / logits_scaling), what the fused loss reads (a head with a
    bias takes the original forward). ``router_aux_loss``: a mixture of experts (Mixtral, Qwen3-MoE)
    whose loss adds router_aux_loss_coef times transformers' load-balancing loss of the router
    logits where output_router_logits asks for them (the attention mask given by keyword: a
    positional one takes the original forward). ``softcaps_logits``: the logits are softcapped by
    config.final_logit_softcapping where it is set (Gemma 2 and 3).
    """
    keep = kwargs.get("logits_to_keep", 0)
    head = self.lm_head
    fused = kwargs.get("labels") is not None and self.training and type(head) is torch.nn.Linear
    fused = fused and not (divides_logits and head.bias is not None) and not (router_aux_loss and len(args) > 1)
    if not (fused and isinstance(keep, int) and keep == 0):
        return original_forward(self, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    base = getattr(self, self.base_model_prefix)
    unpadded = None if router_aux_loss or args else _unpadded_call(base, kwargs)
    if unpadded is not None:
        kwargs = unpadded
    labels = kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if router_aux_loss and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = self.config.output_router_logits
    outputs = base(*args, **kwargs)
    hidden = outputs.last_hidden_state
    if divides_logits:
        hidden = hidden / self.config.logits_scaling
    loss = causal_lm_loss(
        hidden,
        head,
        labels,
        kwargs.get("num_items_in_batch"),
        kwargs.get("ignore_index", -100),
        kwargs.get("shift_labels"),
        getattr(self.config, "final_logit_softcapping", None) if softcaps_logits else None,
    )
    fields = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    if router_aux_loss:
        aux_loss = None
        if kwargs["output_router_logits"]:
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux_loss = balance(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask")
            )
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        output = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, **fields)
    else:
        output = CausalLMOutputWithPast(loss=loss, **fields)
    return output if (self.config.return_dict if return_dict is None else return_dict) else output.to_tuple()


# what a padded training call may pass for `_unpadded_call` (values other than None and False):
# any other input (token_type_ids, a cache, output_hidden_states, ...) keeps the padded batch
_UNPADDED_KWARGS = frozenset(
    {
        "input_ids",
        "inputs_embeds",
        "attention_mask",
        "position_ids",
        "labels",
        "shift_labels",
        "num_items_in_batch",
        "ignore_index",
        "use_cache",
        "return_dict",
        "logits_to_keep",
    }
)


def _unpadded_call(base, kwargs: dict) -> dict | None:
    """The keyword arguments of a padded training call with every row's real tokens laid end to
    end in one row, or None where the call keeps its padded batch: attention that is not fastlm's
    (the attention switch off, or kept for the model), no 2-D right or left padding
    that `_padding` serves, an input outside `_UNPADDED_KWARGS`, or a target at a padded position
    (left padding whose first real token is a label: transformers' loss counts its prediction from
    the last padded position, which only the padded batch computes).

    Every layer then runs on the T real tokens instead of the B x N positions (norms, projections,
    MLPs and RoPE too, not only attention): the batch's rows become the sequences of the
    variable-length kernel (cu_seq_lens_q/k), with the positions transformers gives them (the
    given position_ids, else each token's column); the labels are shifted within each row first,
    so no row's last token predicts the next row's first. The loss is the padded call's; the
    output holds no key/value cache (none is built)."""
    if base.config._attn_implementation != ATTN_IMPLEMENTATION:
        return None  # transformers' attention would see one sequence: only fastlm's reads cu_seq_lens
    passed = {name for name, value in kwargs.items() if value is not None and value is not False}
    if "attention_mask" not in passed or passed - _UNPADDED_KWARGS or "logits_to_keep" in passed:
        return None
    inputs = _inputs((), kwargs)
    padding = _padding(base, kwargs, inputs)
    if padding is None:
        return None
    rows, columns = padding.rows, padding.positions
    ignore_index = kwargs.get("ignore_index", -100)
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        shifted = F.pad(kwargs["labels"], (0, 1), value=ignore_index)[..., 1:]
    shifted = shifted.to(rows.device)
    if bool(((shifted != ignore_index) & ~padding.mask).any()):  # one more wait for the GPU
        return None  # a padded position predicts a target (left padding's first real token): it must run
    positions = kwargs.get("position_ids")
    positions = columns if positions is None else positions.expand(padding.mask.shape)[rows, columns]
    name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    unpadded = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids", "input_ids")}
    unpadded.pop("inputs_embeds", None)
    cu_seqlens, longest = padding.cu_seqlens, padding.max_seqlen
    unpadded.update(
        {
            name: inputs[rows, columns][None],
            "position_ids": positions[None],
            "labels": None,
            "shift_labels": shifted[rows, columns][None],
            "use_cache": False,
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    )
    return unpadded


def causal_lm_loss(
    hidden, lm_head, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None, softcap=None
):
    """transformers' ForCausalLMLoss of ``lm_head(hidden)`` by `fastlm.layers.loss.lm_head_loss`
    (`fastlm.linear_cross_entropy`), the logits softcapped first where ``softcap`` is set (Gemma 2's
    final_logit_softcapping: softcap * tanh(logits / softcap)).

    hidden (B, N, d); labels (B, N), shifted here so that token t predicts label t + 1 (the last
    token predicts nothing), or ``shift_labels`` (B, N) already shifted. The mean over labels that
    are not ``ignore_index``, or with ``num_items_in_batch`` (Trainer's count over the accumulated
    micro-batches) the sum divided by it.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        return lm_head_loss(hidden, lm_head, targets, ignore_index=ignore_index, softcap=softcap)
    total = lm_head_loss(hidden, lm_head, targets, ignore_index=ignore_index, reduction="sum", softcap=softcap)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def signed_like(forward, divides_logits: bool = False, router_aux_loss: bool = False, softcaps_logits: bool = False):
    """`causal_lm_forward` with the family's options under the signature of the ``forward`` it
    replaces: Trainer reads that signature for the dataset columns to keep and for whether to pass
    num_items_in_batch."""

    @functools.wraps(forward)
    def signed(self, *args, **kwargs):
        return causal_lm_forward(self, args, kwargs, divides_logits, router_aux_loss, softcaps_logits)

    return signed
