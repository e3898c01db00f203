"""apply_fastlm / revert_fastlm on tiny random transformers models of each family: the patched model's
loss, logits and every gradient against an unpatched copy (fp32, tight), the kernels each switch
installs, packed sequences and windows, every attention fallback (dropout, non-causal attention, a
static cache's prefill), generate() with and without padding, revert, PEFT, Trainer, gradient
checkpointing and torch.compile; on a GPU the same in bf16, judged by the unpatched model's own
bf16 error. Padded batches: test_huggingface_padding.py."""

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastlm.layers  # noqa: E402
from fastlm.integrations.huggingface import (  # noqa: E402
    FAMILIES,
    apply_fastlm,
    attention_function,
    mask_function,
    revert_fastlm,
)
from fastlm.integrations.huggingface import attention as hf_attention  # noqa: E402

# each family's config class and what its tiny config sets beyond `tiny_model`'s sizes: the options
# in which the family differs from Llama, at values that are not their defaults' no-ops
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 4.0},
    ),
    "olmo2": ("Olmo2Config", {}),
    # a window shorter than the sequences in layer 0
    "olmo3": ("Olmo3Config", {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]}),
    "glm4": ("Glm4Config", {}),  # its defaults: partial rotary (half of each head), interleaved pairs, q/k/v biases
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0]}),  # layer 1 without RoPE
    # partial rotary and longrope over the first 8 of 16 dims (4 angles); sequences longer than 8
    # tokens take the long factors, and longrope scales the tables (attention_factor != 1)
    "phi3": (
        "Phi3Config",
        {
            "original_max_position_embeddings": 8,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 3.0, 5.0, 8.0],
            },
        },
    ),
    # the routers' load-balancing loss in the loss (coefficient 0.1, not 0.001, so that it counts);
    # experts of width 32 (the interpreter's time grows with the experts' tiles)
    "mixtral": (
        "MixtralConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    "qwen3_moe": (  # and a dense MLP in layer 1
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
        },
    ),
    # (1 + weight) norms, sqrt(hidden) embedding scale, GeGLU (tanh form) MLPs
    "gemma": ("GemmaConfig", {}),
    # and sandwich norms, a query scale that is not 1 / sqrt(head_dim), alternating windows shorter
    # than the sequences; the attention scores softcapped at 1 and the logits at 2 (released
    # models: 50 and 30), which changes them for sure. Eager attention: transformers gives Gemma 2
    # no SDPA
    "gemma2": (
        "Gemma2Config",
        {
            "attn_implementation": "eager",
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 24,
            "sliding_window": 3,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # and q_norm / k_norm per head, RoPE bases per layer type (its defaults: 1e4 local, 1e6 global)
    "gemma3_text": (
        "Gemma3TextConfig",
        {"query_pre_attn_scalar": 24, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}
# the calls of rms_norm, rotary_embedding and the gated MLP's op in one forward of a 2-layer tiny
# model: 2 norms a layer and the final one, 2 more for per-head or per-projection q_norm / k_norm
# (Qwen3, OLMo) or GLM-4's and Gemma 2's post norms (Gemma 3: both); a rotation per layer with
# RoPE; a swiglu (geglu: `GELU_FAMILIES`) per dense MLP; a moe_experts per layer of experts
# (`EXPERT_LAYERS`)
KERNEL_CALLS = {
    "llama": (5, 2, 2),
    "mistral": (5, 2, 2),
    "qwen2": (5, 2, 2),
    "qwen3": (9, 2, 2),
    "granite": (5, 2, 2),
    "olmo2": (9, 2, 2),
    "olmo3": (9, 2, 2),
    "glm4": (9, 2, 2),
    "smollm3": (5, 1, 2),
    "phi3": (5, 2, 2),
    "mixtral": (5, 2, 0),
    "qwen3_moe": (9, 2, 1),
    "gemma": (5, 2, 2),
    "gemma2": (9, 2, 2),
    "gemma3_text": (13, 2, 2),
}
GELU_FAMILIES = ("gemma", "gemma2", "gemma3_text")  # their MLPs run fastlm.geglu
EXPERT_LAYERS = {"mixtral": 2, "qwen3_moe": 1}
VOCAB = 300
FP32 = {"rtol": 1e-4, "atol": 1e-6}  # the kernels against PyTorch's fp32 ops: summation order only
# logits of a few units: the summation order moves them by a few of their ulps (OLMo 3's: 1.2e-6)
LOGITS = {"rtol": 1e-4, "atol": 1e-5}
# each switch of apply_fastlm and the fastlm op it installs
OPS = {
    "attention": "flash_attention",
    "norm": "rms_norm",
    "rope": "rotary_embedding",
    "mlp": "swiglu",
    "loss": "linear_cross_entropy",
}
# the fastlm.layers module each op is called from
OP_LAYERS = {
    "flash_attention": "attention",
    "flash_attention_varlen": "attention",
    "rms_norm": "norms",
    "rotary_embedding": "rotary",
    "swiglu": "mlp",
    "geglu": "mlp",
    "linear_cross_entropy": "loss",
    "moe_experts": "moe",
}


def tiny_model(family: str, layers: int = 2, hidden: int = 64, heads: int = 4, **overrides):
    """A random model of ``family`` (its `CONFIGS` settings, sized to ``layers`` and the heads) with
    SDPA attention; by default hidden 64, 4 query and 2 key/value heads of 16, 2 layers.
    initializer_range 0.1 (not 0.02) keeps greedy decoding away from ties between random logits."""
    config_name, family_settings = CONFIGS[family]
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        initializer_range=0.1,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    settings.update(_sized(family_settings, layers, overrides.get("head_dim", hidden // heads)), **overrides)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_class(**settings))


def _sized(family_settings: dict, layers: int, head_dim: int) -> dict:
    """`CONFIGS`' settings for ``layers`` layers of ``head_dim``: per-layer patterns repeat over the
    layers, longrope's factors (one per rotated pair of dims) over the pairs."""
    settings = dict(family_settings)

    def repeated(pattern, length):
        return [pattern[i % len(pattern)] for i in range(length)]

    for key in ("layer_types", "no_rope_layers"):
        if key in settings:
            settings[key] = repeated(settings[key], layers)
    rope = settings.get("rope_parameters", {})
    if "short_factor" in rope:
        pairs = int(head_dim * rope["partial_rotary_factor"]) // 2
        factors = {key: repeated(rope[key], pairs) for key in ("short_factor", "long_factor")}
        settings["rope_parameters"] = {**rope, **factors}
    return settings


def patched_pair(family: str, **switches):
    """(patched model, unpatched deep copy), both in training mode."""
    model = tiny_model(family)
    reference = copy.deepcopy(model)
    apply_fastlm(model, **switches)
    return model.train(), reference.train()


def tokens(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length))


def assert_same_step(model, reference, **inputs):
    """One forward and backward of each; the losses and every parameter's gradient match. Returns
    the patched model's output."""
    output = model(**inputs)
    loss = output.loss
    loss.backward()
    expected = reference(**inputs).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, **FP32)
    for (name, param), expected_param in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (param.grad is None) == (expected_param.grad is None), name
        if param.grad is not None:
            torch.testing.assert_close(param.grad, expected_param.grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    return output


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "runs transformers' SDPA" in str(w.message)]


def kept_warnings(record) -> list[str]:
    """What `apply_fastlm` said it leaves to transformers."""
    return [str(w.message) for w in record if str(w.message).startswith("apply_fastlm leaves")]


def instance_forwards(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees the one-time fallback warnings afresh."""
    monkeypatch.setattr(hf_attention, "_warned_fallbacks", set())


@pytest.fixture
def op_calls(monkeypatch):
    """Counts the calls of each fastlm op the patch runs."""
    counts = dict.fromkeys([*OPS.values(), "geglu", "flash_attention_varlen", "moe_experts"], 0)

    def counting(name):
        op = getattr(getattr(fastlm.layers, OP_LAYERS[name]), name)

        def call(*args, **kwargs):
            counts[name] += 1
            return op(*args, **kwargs)

        return call

    for name in counts:
        monkeypatch.setattr(getattr(fastlm.layers, OP_LAYERS[name]), name, counting(name))
    return counts


@pytest.mark.parametrize("family", list(CONFIGS))
def test_training_step_and_logits_match_unpatched(family, op_calls, recwarn):
    model, reference = patched_pair(family)
    ids = tokens()
    output = assert_same_step(model, reference, input_ids=ids, labels=ids)
    norms, rotations, gated = KERNEL_CALLS[family]
    assert op_calls == {
        "flash_attention": 2,
        "rms_norm": norms,
        "rotary_embedding": rotations,
        "swiglu": 0 if family in GELU_FAMILIES else gated,
        "geglu": gated if family in GELU_FAMILIES else 0,
        "linear_cross_entropy": 1,
        "flash_attention_varlen": 0,
        "moe_experts": EXPERT_LAYERS.get(family, 0),
    }
    assert output.logits is None  # the fused loss holds no logits
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, **LOGITS)
    assert not fallback_warnings(recwarn) and not kept_warnings(recwarn)


@pytest.mark.parametrize("switch", list(OPS))
def test_each_switch_installs_only_its_kernel(switch, op_calls):
    model = tiny_model("llama")
    apply_fastlm(model)
    apply_fastlm(model, **{switch: False})  # applying again replaces the earlier patch
    ids = tokens()
    model.train()(input_ids=ids, labels=ids)
    assert op_calls[OPS[switch]] == 0
    assert all(op_calls[name] > 0 for name in OPS.values() if name != OPS[switch])


def test_all_ones_attention_mask_runs_the_kernel(op_calls, recwarn):
    model, reference = patched_pair("llama")
    ids = tokens()
    assert_same_step(model, reference, input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert op_calls["flash_attention"] == 2 and not fallback_warnings(recwarn)


def test_packed_position_ids_match_unpatched(op_calls, recwarn):
    """DataCollatorWithFlattening's format: one row, position_ids restarting at each sequence, and
    no cache (transformers looks for restarts only then; Trainer sets use_cache=False). The patched
    base model turns the restarts into cu_seq_lens for the variable-length kernel; the rotation,
    one row of positions, stays on its kernel too."""
    model, reference = patched_pair("llama")
    ids = tokens(1, 9)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    labels = ids.clone()
    labels[0, [0, 4, 7]] = -100  # each sequence's first token is no target of the one before
    assert_same_step(model, reference, input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False)
    assert op_calls["rotary_embedding"] == 2 and op_calls["flash_attention_varlen"] == 2
    assert op_calls["flash_attention"] == 0 and not fallback_warnings(recwarn)
    # with a cache transformers does not look for restarts: one sequence, in both models
    model.zero_grad(), reference.zero_grad()
    assert_same_step(model, reference, input_ids=ids, position_ids=position_ids, labels=labels, use_cache=True)
    assert op_calls["flash_attention_varlen"] == 2 and not fallback_warnings(recwarn)


def test_packed_rows_match_unpatched(op_calls, recwarn):
    """Several rows, each with position ids restarting at its sequences (transformers keeps the
    sequences of every row apart): one variable-length call over the rows laid end to end; a row
    that is one sequence is a sequence of its own."""
    model, reference = patched_pair("llama")
    ids = tokens(3, 6)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 0]])
    assert_same_step(model, reference, input_ids=ids, position_ids=position_ids, labels=ids, use_cache=False)
    assert op_calls["flash_attention_varlen"] == 2 and op_calls["flash_attention"] == 0
    assert not fallback_warnings(recwarn)


def test_cu_seq_lens_alone_keep_the_sequences_apart(op_calls, recwarn):
    """Packed sequences given only as flash-attention offsets (no position_ids): transformers builds
    no mask; the variable-length kernel takes the offsets. Each sequence's logits equal those of the
    sequence run alone (RoPE is relative: the shift of its positions in the pack does not count)."""
    model = tiny_model("mistral")
    apply_fastlm(model)
    model.eval()
    first, second = tokens(1, 5), tokens(1, 4)
    offsets = torch.tensor([0, 5, 9], dtype=torch.int32)
    packing = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=5, max_length_k=5)
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], dim=1), **packing).logits
        torch.testing.assert_close(packed[:, :5], model(input_ids=first).logits, **FP32)
        torch.testing.assert_close(packed[:, 5:], model(input_ids=second).logits, **FP32)
    assert op_calls["flash_attention_varlen"] == 2 and not fallback_warnings(recwarn)


def test_sliding_window_shorter_than_the_sequence_matches_unpatched(op_calls, recwarn):
    model = tiny_model("mistral", sliding_window=3)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = tokens()
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    assert op_calls["flash_attention"] == 2 and not fallback_warnings(recwarn)
    # packed and windowed at once
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    model.zero_grad(), reference.zero_grad()
    assert_same_step(
        model, reference, input_ids=tokens(1, 8), position_ids=position_ids, labels=tokens(1, 8), use_cache=False
    )
    assert op_calls["flash_attention_varlen"] == 2 and not fallback_warnings(recwarn)


def _attention_inputs(queries: int = 5, keys: int = 5):
    return torch.randn(2, 4, queries, 8), torch.randn(2, 2, keys, 8), torch.randn(2, 2, keys, 8)


@pytest.mark.parametrize(
    ("case", "keys", "kwargs"),
    [
        ("attention dropout", 5, {"dropout": 0.5}),
        ("attention dropout", 5, {"dropout": 0.5, "sliding_window": 3}),  # a window the mask did not carry
        ("non-causal", 5, {"is_causal": False}),
        ("more keys than queries", 7, {}),  # a static cache's prefill
        # two rows of packed sequences (3 + 2 and 5 tokens) under dropout: the mask keeps them apart
        ("attention dropout", 5, {"dropout": 0.5, "cu_seq_lens": [0, 3, 5, 10]}),
    ],
)
def test_cases_the_kernel_does_not_cover_run_sdpa(case, keys, kwargs, recwarn):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = _attention_inputs(keys=keys)
    bounds = kwargs.pop("cu_seq_lens", None)
    packing = {}
    if bounds is not None:
        offsets = torch.tensor(bounds, dtype=torch.int32)
        packing = {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": 5, "max_length_k": 5}
    torch.manual_seed(1)  # dropout draws the same mask in both
    out, _ = attention_function(module, q, k, v, None, scaling=0.3, **packing, **kwargs)
    torch.manual_seed(1)
    if bounds is not None:  # what transformers' mask would have carried: causal, within each sequence
        same = torch.tensor([[0, 0, 0, 1, 1], [2, 2, 2, 2, 2]])  # each row's tokens' sequence
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        kwargs["attention_mask"] = (causal & (same[:, :, None] == same[:, None, :]))[:, None]
    window = kwargs.pop("sliding_window", None)
    if window is not None:  # what transformers' mask would have carried: key j seen by query i iff i - w < j <= i
        rows, cols = torch.arange(5)[:, None], torch.arange(keys)[None, :]
        kwargs["attention_mask"] = (cols <= rows) & (cols > rows - window)
    expected, _ = sdpa_attention_forward(module, q, k, v, kwargs.pop("attention_mask", None), scaling=0.3, **kwargs)
    torch.testing.assert_close(out, expected)
    assert case in fallback_warnings(recwarn)[0]


def test_kernel_output_has_transformers_layout():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = _attention_inputs()
    out, weights = attention_function(module, q, k, v, None, scaling=0.3)
    assert out.shape == (2, 5, 4, 8) and weights is None  # (B, N, H, D)
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, None, scaling=0.3)[0], **FP32)
    decode, _ = attention_function(module, q[:, :, -1:], k, v, None, scaling=0.3)  # one query sees every key
    torch.testing.assert_close(decode, out[:, -1:], **FP32)


def test_mask_function_drops_only_a_plain_causal_mask(monkeypatch):
    """transformers 4 keeps the causal mask it builds to look for packed sequences; so does 5 while
    torch.compile traces (then it stays)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    padded = causal.clone()
    padded[1, :, :, 0] = False
    for built, expected in ((causal, None), (padded, padded)):
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS, "sdpa", lambda *args, built=built, **kwargs: built)
        assert mask_function(batch_size=2) is expected
        assert torch.compile(mask_function, backend="eager", fullgraph=True)(batch_size=2) is not None


@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded-batch"])
def test_greedy_generate_gives_the_same_tokens(padded):
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = tokens(2 if padded else 1, 6)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :2], mask[1, :2] = 0, 0
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    generated = model.eval().generate(ids, **settings)
    assert torch.equal(generated, reference.eval().generate(ids, **settings))


def test_revert_restores_the_original_forwards_and_attention():
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    assert model.config._attn_implementation == "fastlm" and len(instance_forwards(model)) > 0
    revert_fastlm(model)
    assert model.config._attn_implementation == "sdpa" and instance_forwards(model) == []
    ids = tokens()
    model.train(), reference.train()
    assert torch.equal(model(input_ids=ids, labels=ids).logits, reference(input_ids=ids, labels=ids).logits)
    assert revert_fastlm(model) is model  # reverting an unpatched model changes nothing


def test_patch_is_per_instance():
    norm_forward = transformers.models.llama.modeling_llama.LlamaRMSNorm.forward
    model = tiny_model("llama")
    apply_fastlm(model)
    later = tiny_model("llama")
    assert instance_forwards(later) == [] and later.config._attn_implementation == "sdpa"
    assert transformers.models.llama.modeling_llama.LlamaRMSNorm.forward is norm_forward
    copied = copy.deepcopy(model)  # a copy's rebound forwards belong to the copy
    assert copied.model.norm.forward.__self__ is copied.model.norm
    revert_fastlm(copied)
    assert instance_forwards(copied) == [] and len(instance_forwards(model)) > 0


def test_unsupported_model_is_an_error_and_stays_unpatched():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3.*GPT2LMHeadModel.*'gpt2'"):
        apply_fastlm(model)
    assert instance_forwards(model) == [] and model.config._attn_implementation == implementation
    assert sorted(FAMILIES) == sorted(CONFIGS)


def test_weights_the_kernels_do_not_take_and_non_bool_switches_are_errors():
    model = tiny_model("llama").double()
    with pytest.raises(ValueError, match="weights of float32, float16, bfloat16 .* got float64"):
        apply_fastlm(model)
    assert instance_forwards(model) == []
    with pytest.raises(TypeError, match="attention must be True or False, got 'no'"):
        apply_fastlm(tiny_model("llama"), attention="no")
    with pytest.raises(TypeError, match="norm must be True, False, 'auto', 'fastlm' or 'torch', got 'apex'"):
        apply_fastlm(tiny_model("llama"), norm="apex")


def test_fastlm_switch_values_run_the_kernels_while_compiling_and_torch_leaves_them_out(op_calls):
    """norm="fastlm" keeps the kernel under torch.compile (True, "auto", gives way to transformers'
    code there); mlp="torch" is False: the MLPs keep their forward."""
    model = apply_fastlm(tiny_model("llama"), norm="fastlm", rope=True, mlp="torch")
    torch._dynamo.reset()
    torch.compile(model, backend="eager", fullgraph=True)(input_ids=tokens())  # traced: fast
    assert op_calls["rms_norm"] == 2 * 2 + 1 and op_calls["rotary_embedding"] == 0 and op_calls["swiglu"] == 0
    assert not any("mlp" in name for name in instance_forwards(model))


@pytest.mark.parametrize(
    "loss_inputs",
    [
        {"num_items_in_batch": torch.tensor(5)},  # Trainer's count over accumulated micro-batches
        {"shift_labels": "shifted"},
        {"return_dict": False},
    ],
    ids=["num_items_in_batch", "shift_labels", "tuple"],
)
def test_loss_inputs_match_unpatched(loss_inputs):
    model, reference = patched_pair("qwen2", attention=False, norm=False, rope=False, mlp=False)
    ids = tokens()
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    if "shift_labels" in loss_inputs:
        loss_inputs = {"shift_labels": torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()}
        labels = torch.full_like(ids, 7)  # ignored when shift_labels are given
    outputs = model(input_ids=ids, labels=labels, **loss_inputs)
    torch.testing.assert_close(outputs[0], reference(input_ids=ids, labels=labels, **loss_inputs)[0], **FP32)
    values = outputs if isinstance(outputs, tuple) else outputs.to_tuple()
    assert isinstance(outputs, tuple) == ("return_dict" in loss_inputs)
    assert not any(torch.is_tensor(value) and value.dim() == 3 for value in values)  # no (B, N, V) logits


@pytest.mark.parametrize("adapted", [["q_proj", "v_proj", "up_proj"], ["lm_head"]], ids=["layers", "lm_head"])
def test_peft_model_is_patched_through_its_base_model(adapted):
    """Adapters on the projections run inside the patched modules; one on lm_head keeps
    transformers' loss (the fused loss reads a plain Linear's weight)."""
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: random adapters (not B = 0), so every adapter weight has a gradient
    lora = peft.LoraConfig(r=4, target_modules=adapted, init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama"), lora)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = tokens()
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    assert (model(input_ids=ids, labels=ids).logits is None) == ("lm_head" not in adapted)
    revert_fastlm(model)
    assert instance_forwards(model) == []


def test_gradient_checkpointing_matches_unpatched(op_calls):
    model, reference = patched_pair("llama")
    model.gradient_checkpointing_enable()
    ids = tokens()
    assert_same_step(model, reference, input_ids=ids, labels=ids)
    assert op_calls["flash_attention"] == 4  # each layer's forward again in the backward


def test_trainer_losses_match_unpatched(tmp_path, op_calls):
    """Two optimizer steps of two accumulated micro-batches each: Trainer passes num_items_in_batch,
    and the second step's loss follows the first update."""
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    ids = tokens(8, 8)
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)  # micro-batches count different targets
    data = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels, strict=True)]

    def train(model, name):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model, reference = patched_pair("llama")
    losses, expected = train(model, "patched"), train(reference, "unpatched")
    assert len(losses) == 2
    assert op_calls["linear_cross_entropy"] == 4 and op_calls["flash_attention"] == 8  # 4 micro-batches
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_torch_compile_traces_the_patched_model_in_one_graph(op_calls):
    """aot_eager: Dynamo's trace and the autograd graph (no graph break), without Inductor's CPU
    compile time; Inductor runs on the GPU test. The attention kernel is in the graph with and
    without a cache (without one, transformers builds a mask while tracing; the patched base model
    knows it is plain causal); with explicit position ids it cannot know, and SDPA runs."""
    model, reference = patched_pair("qwen3")
    ids = tokens()
    for use_cache, positions in ((True, None), (False, None), (False, torch.arange(8)[None])):
        torch._dynamo.reset()
        op_calls["flash_attention"] = 0
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert_same_step(compiled, reference, input_ids=ids, labels=ids, use_cache=use_cache, position_ids=positions)
        assert (op_calls["flash_attention"] > 0) == (positions is None), (use_cache, positions)
        model.zero_grad(), reference.zero_grad()


def test_importing_fastlm_does_not_import_transformers():
    code = "import sys, fastlm; fastlm.apply_fastlm; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------
# GPU: bf16 weights and bf16 autocast over fp32 weights, at a moderate size
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_tf32(monkeypatch):
    """fp32 matmuls in full fp32, for the fp32 references."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return ((value.double() - exact.double()).norm() / exact.double().norm()).item()


def step_values(model, ids, autocast: bool):
    """The loss and every parameter's gradient of one training step, on the GPU."""
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [param.grad.detach().clone() for param in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-weights", "bf16-autocast"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_bf16_error_is_within_the_unpatched_models(family, precision, no_tf32):
    """Against the fp32 unpatched model, the patched model's loss and every gradient are no further
    than 1.5x the unpatched model's own bf16 error (measured on an H100: at most 1.1x for the
    gradients, about 1% each), plus a floor for the loss, which bf16 gets near-exact (~1e-5)."""
    # transformers' default init: the tests' 0.1 makes bf16's own gradient error ~40%, no yardstick
    exact_model = tiny_model(family, layers=4, hidden=512, heads=8, initializer_range=0.02).cuda()
    ids = torch.randint(1, VOCAB, (2, 512), device="cuda")
    exact = step_values(exact_model.train(), ids, autocast=False)
    autocast = precision == "bf16-autocast"
    unpatched = copy.deepcopy(exact_model) if autocast else copy.deepcopy(exact_model).bfloat16()
    patched = copy.deepcopy(unpatched)
    apply_fastlm(patched)
    baseline = step_values(unpatched.train(), ids, autocast)
    values = step_values(patched.train(), ids, autocast)
    names = ["loss"] + [name for name, _ in exact_model.named_parameters()]
    for name, value, reference, exact_value in zip(names, values, baseline, exact, strict=True):
        # a router's gradient, and its experts', follow its top-k choices, which a token near a tie flips
        # on any rounding (on an H200: Mixtral's layer-1 router 1.51x the unpatched model's own 8% bf16
        # error, layer 2's experts' down_proj 1.89x its 2.4%); test_moe.py checks the experts' own
        # accuracy on fixed routes
        routed = name.endswith("mlp.gate.weight") or ".mlp.experts." in name  # dense MLPs have gate_proj
        factor = 2.5 if routed else 1.5
        allowed = factor * relative_error(reference, exact_value) + 1e-4
        assert relative_error(value, exact_value) <= allowed, name


@pytest.mark.gpu
def test_inductor_compiled_patched_model_matches_unpatched(no_tf32):
    model, reference = patched_pair("llama")
    model.cuda(), reference.cuda()
    compiled = torch.compile(model, fullgraph=True)
    ids = tokens().cuda()
    for use_cache in (True, False):  # without a cache transformers builds a mask while tracing
        assert_same_step(compiled, reference, input_ids=ids, labels=ids, use_cache=use_cache)
        model.zero_grad(), reference.zero_grad()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 48])
def test_packed_sequences_match_unpatched_on_gpu(window, no_tf32, op_calls, recwarn):
    # one row of 128 tokens packing sequences of 50, 1 and 77 tokens, with Mistral's window or none
    model = tiny_model("mistral", sliding_window=window).cuda()
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = tokens(1, 128).cuda()
    position_ids = torch.cat([torch.arange(50), torch.arange(1), torch.arange(77)])[None].cuda()
    assert_same_step(
        model.train(), reference.train(), input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False
    )
    assert op_calls["flash_attention_varlen"] == 2 and not fallback_warnings(recwarn)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(CONFIGS))
def test_fp32_step_and_generate_match_unpatched_on_gpu(family, no_tf32):
    model, reference = patched_pair(family)
    model.cuda(), reference.cuda()
    ids = tokens(2, 128).cuda()
    assert_same_step(model, reference, input_ids=ids, labels=ids)
    settings = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(model.eval().generate(ids[:1], **settings), reference.eval().generate(ids[:1], **settings))
