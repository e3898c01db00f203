"""Training runs of every family `apply_fastlm` supports: a patched and an unpatched copy of one tiny
random model, trained by AdamW on the same batches, keep the same loss at every step, the same final
logits and the same weights; the fallback of an option the patch cannot serve; OLMo's norm dtype.

On a CPU the runs take the ops' PyTorch reference paths (TRITON_INTERPRET unset for the test): the
interpreter costs about 15 ms per program, a second per step of the tiniest model, and one step of
every kernel under it is `test_training_step_and_logits_match_unpatched`'s. What the runs check is
the patch's own math over many updates (which forward each module gets, partial and interleaved
rotary, post norms, logits scaling, the routers' loss), which the reference paths compute as the
kernels do. On a GPU the same runs go through the kernels in bf16 (`test_bf16_training_...`).
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastlm.integrations.huggingface import apply_fastlm, attention_function  # noqa: E402

from . import test_huggingface  # noqa: E402
from .test_huggingface import (  # noqa: E402
    CONFIGS,
    assert_same_step,
    kept_warnings,
    relative_error,
    tiny_model,
)

op_calls = test_huggingface.op_calls  # the fixture counting the fastlm ops the patch runs

STEPS = 32
VOCAB = 128
LEARNING_RATE = 3e-3  # the loss falls from ~5 to ~2 in the 32 steps (Granite's, scaled down, to ~4)
# 32 fp32 AdamW steps, patched against unpatched, where the ops reorder fp32 sums: measured (the 14
# other families, 2 layers of hidden 32) at most 5.4e-7 relative for the losses, 4.9e-5 absolute for
# the logits (of ~5) and 5e-5 for the weights (of ~0.1, moved by ~0.1); the tolerances are 4-10x that.
# AdamW's normalized steps turn rounding into lr-sized moves where a gradient is near zero, and a
# loss that has fallen further (lr 1e-2) doubles or triples each measure
LOSSES = {"rtol": 5e-6, "atol": 0.0}
LOGITS = {"rtol": 1e-4, "atol": 2e-4}
WEIGHTS = {"rtol": 1e-4, "atol": 2e-4}
# Gemma 3's tiny model amplifies the same first-step differences (9e-8 in the loss) about 100x over
# the 32 steps: measured 9.1e-6 for the losses, 3.4e-4 for the logits, 2.2e-4 for the weights
AMPLIFIES = {"gemma3_text": 5}


@pytest.fixture
def reference_paths(monkeypatch):
    """The ops' PyTorch reference paths on CPU tensors (module docstring)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def batches(count: int = 4, batch: int = 2, length: int = 16, vocab: int = VOCAB) -> list[torch.Tensor]:
    """A few fixed batches the runs cycle through: the model learns them, so the loss falls."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (batch, length), generator=generator) for _ in range(count)]


def train(model, data: list[torch.Tensor], steps: int = STEPS) -> torch.Tensor:
    """The loss before each of ``steps`` AdamW steps on ``data`` in turn, as one fp32 tensor."""
    optimizer = torch.optim.AdamW(model.train().parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(steps):
        ids = data[step % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def compared_weights(model) -> dict[str, torch.Tensor]:
    """Each parameter, where training moves it: a key bias leaves out the dims of each head that no
    rotation reaches (GLM-4's partial rotary), where q . b_k is the same for every key and softmax
    cancels it, so its gradient is rounding alone (AdamW turns that into lr-sized steps either way)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    rotated = int(model.model.layers[0].self_attn.head_dim * rope.get("partial_rotary_factor", 1.0))
    weights = {}
    for name, param in model.named_parameters():
        if name.endswith("k_proj.bias"):
            param = param.view(config.num_key_value_heads, -1)[:, :rotated]
        weights[name] = param.detach()
    return weights


@pytest.mark.parametrize("family", list(CONFIGS))
def test_training_run_matches_unpatched(family, reference_paths, op_calls):
    model = tiny_model(family, hidden=32, heads=2, vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    data = batches()
    losses, expected = train(model, data), train(reference, data)
    assert op_calls["linear_cross_entropy"] == STEPS  # every step took the patched loss
    assert expected[-len(data) :].mean() < expected[: len(data)].mean() - 0.5  # it learns the batches
    factor = AMPLIFIES.get(family, 1)
    losses_tol, logits_tol, weights_tol = ({k: v * factor for k, v in t.items()} for t in (LOSSES, LOGITS, WEIGHTS))
    torch.testing.assert_close(losses, expected, **losses_tol)
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=data[0]).logits, reference(input_ids=data[0]).logits, **logits_tol)
    expected_weights = compared_weights(reference)
    for name, weight in compared_weights(model).items():
        torch.testing.assert_close(
            weight, expected_weights[name], **weights_tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_an_activation_swiglu_does_not_cover_keeps_the_mlp_with_one_warning(op_calls, recwarn):
    """Phi-3 with GELU in its gate_up_proj MLP: the MLP keeps transformers' forward (warned once, when
    the patch is applied), everything else runs the kernels, and the model is the unpatched one."""
    model = tiny_model("phi3", hidden_act="gelu_new")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = batches(1, length=8)[0]
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    fastlm_messages = [str(w.message) for w in recwarn if "fastlm" in str(w.message)]
    assert fastlm_messages == [
        "apply_fastlm leaves the MLPs as they are: hidden_act 'gelu_new' is not one fastlm fuses "
        "(silu, swish, gelu_pytorch_tanh, gelu)"
    ]
    assert op_calls["swiglu"] == op_calls["geglu"] == 0
    assert op_calls["rotary_embedding"] == 2 and op_calls["linear_cross_entropy"] == 1
    assert not any(name.endswith("mlp") for name, module in model.named_modules() if "forward" in module.__dict__)


def test_exact_gelu_mlp_runs_geglu_on_the_halves_of_gate_up_proj(op_calls, recwarn):
    """Phi-3 with transformers' exact "gelu": `fastlm.geglu(approximate="none")` on the two halves of
    its one gate_up_proj, the same model as the unpatched one."""
    model = tiny_model("phi3", hidden_act="gelu")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = batches(1, length=8)[0]
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    assert op_calls["geglu"] == 2 and op_calls["swiglu"] == 0 and not kept_warnings(recwarn)


def test_gemma2_softcaps_run_in_the_kernels(op_calls, recwarn):
    """Gemma 2's softcaps of the attention scores and of the logits: the attention kernel softcaps
    the scores, the fused loss the logits; in evaluation with a cache, the mask goes to Gemma 2's
    own eager attention (SDPA has no softcap), warned once. The model is the unpatched one.
    Softcaps of 1 and 2 (the defaults are 50 and 30) change the tiny model's values for sure."""
    model = tiny_model("gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=2.0)
    # the same weights (seeded), no softcaps: far from the capped model
    uncapped = tiny_model("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = batches(1, length=8)[0]
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    assert not kept_warnings(recwarn)
    assert op_calls["flash_attention"] == 2 and op_calls["linear_cross_entropy"] == 1
    assert model.config._attn_implementation == "fastlm"
    assert op_calls["rms_norm"] == 9 and op_calls["rotary_embedding"] == 2 and op_calls["geglu"] == 2
    model.eval(), reference.eval(), uncapped.eval()
    with torch.no_grad():
        for use_cache in (False, True):
            logits = model(input_ids=ids, use_cache=use_cache).logits
            torch.testing.assert_close(logits, reference(input_ids=ids).logits, **LOGITS)
        assert not torch.allclose(logits, uncapped(input_ids=ids).logits, rtol=1e-2, atol=1e-2)
        generated = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, reference.generate(ids[:, :4], max_new_tokens=4, do_sample=False))
    assert [str(w.message) for w in recwarn if "eager attention" in str(w.message)]


@pytest.mark.parametrize(
    "queries,keys,causal,eager",
    [(3, 5, True, True), (1, 5, True, False), (4, 4, False, True)],
    ids=["static-cache-prefill", "decoding-step", "non-causal"],
)
def test_softcapped_calls_give_sdpas_result(queries, keys, causal, eager, recwarn):
    """With a softcap too wide to bend any score (1e6), a softcapped call gives transformers' SDPA
    result for the same call: through the kernel where it covers the call (one query: a decoding
    step), through Gemma 2's eager attention where it does not (more keys than queries without a
    mask, aligned top-left as SDPA aligns a static cache's prefill; non-causal), warned."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = tiny_model("gemma2").model.layers[0].self_attn
    module.is_causal = causal
    q = torch.randn(1, 4, queries, 16)
    k, v = torch.randn(1, 2, keys, 16), torch.randn(1, 2, keys, 16)
    out, _ = attention_function(module, q, k, v, None, scaling=0.25, softcap=1e6)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert any("eager attention" in str(w.message) for w in recwarn) == eager


def test_bidirectional_attention_keeps_transformers_attention_with_one_warning(op_calls, recwarn):
    """Gemma 3 with use_bidirectional_attention (embedding models): not causal, so the attention
    keeps transformers' (its masks, sliding windows included); the rest runs the kernels."""
    model = tiny_model("gemma3_text", use_bidirectional_attention=True)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids = batches(1, length=8)[0]
    assert_same_step(model.train(), reference.train(), input_ids=ids, labels=ids)
    assert kept_warnings(recwarn) == [
        "apply_fastlm leaves the attention as it is: use_bidirectional_attention is not causal attention"
    ]
    assert op_calls["flash_attention"] == 0 and op_calls["geglu"] == 2 and op_calls["linear_cross_entropy"] == 1
    assert model.config._attn_implementation == "sdpa"  # not "fastlm"


def test_gemma3_head_dim_256_is_as_accurate_as_unpatched(op_calls):
    """Gemma 3's head dim of 256 through the attention kernel, in fp32 against the unpatched model
    in float64: the patched loss and every gradient no further from it than 2x the unpatched fp32
    model's own error plus 1e-6 (both measured at about 3e-6 at most, the patched one the lower;
    the 256-long dot products under a 1 / sqrt(24) scale pass the direct comparison's 1e-6
    absolute on a few elements in either order of summation)."""
    model = tiny_model("gemma3_text", heads=2, head_dim=256)
    unpatched, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    apply_fastlm(model)
    ids = batches(1, length=8)[0]
    values = []
    for each in (model, unpatched, exact):
        loss = each.train()(input_ids=ids, labels=ids).loss
        loss.backward()
        values.append([loss.detach()] + [param.grad for param in each.parameters()])
    assert op_calls["flash_attention"] == 2 and model.model.layers[0].self_attn.head_dim == 256
    names = ["loss"] + [name for name, _ in model.named_parameters()]
    for name, ours, theirs, truth in zip(names, *values, strict=True):
        assert relative_error(ours, truth) <= 2 * relative_error(theirs, truth) + 1e-6, name


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma"])
def test_norm_output_dtype_is_the_familys(family):
    """bf16 activations through an fp32-weight norm, outside autocast: Llama's norm returns the
    promotion (fp32), OLMo's ``(weight * normed).to(input dtype)`` and Gemma's
    ``(normed * (1 + weight)).type_as(input)`` bf16, rounded once from fp32."""
    model = tiny_model(family, layers=1)
    norm = model.model.norm
    reference = copy.deepcopy(norm)
    apply_fastlm(model)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not all ones: the weight's multiply counts
        reference.weight.copy_(norm.weight)
        x = torch.randn(2, 5, norm.weight.shape[0]).bfloat16()
        out, expected = norm(x), reference(x)
    assert out.dtype == expected.dtype == (torch.float32 if family == "llama" else torch.bfloat16)
    # one bf16 rounding apart at most (Llama's rounds normed to bf16 first; the kernel does not)
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=0.0)


# ----------------------------------------------------------------------------------------------
# GPU: the kernels in bf16, judged by the unpatched model's own bf16 error
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(CONFIGS))
def test_bf16_training_run_is_within_the_unpatched_models_error(family, monkeypatch):
    """32 steps in bf16 weights (AdamW state in bf16 too) of the patched and the unpatched model
    against the unpatched model in fp32 from the same weights: the patched loss curve and each final
    weight may be no further from fp32 than 3x the unpatched model's own bf16 error plus a floor.
    Two bf16 runs are two draws of rounding noise, the same size but not ordered: on a CPU (the
    ops' reference paths, 8 steps of 32 tokens) the patched model's loss error was up to 3.3x the
    unpatched one's, within 4.3e-3, and its weights' within 2.4x plus 1.2e-3. Not yet measured on a GPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    exact_model = tiny_model(family, hidden=256, heads=16, initializer_range=0.02).cuda()
    unpatched = copy.deepcopy(exact_model).bfloat16()
    patched = copy.deepcopy(unpatched)
    apply_fastlm(patched)
    data = [ids.cuda() for ids in batches(length=256, vocab=exact_model.config.vocab_size)]
    exact, baseline, losses = train(exact_model, data), train(unpatched, data), train(patched, data)
    assert relative_error(losses, exact) <= 3 * relative_error(baseline, exact) + 5e-3
    exact_weights, baseline_weights = compared_weights(exact_model), compared_weights(unpatched)
    for name, weight in compared_weights(patched).items():
        allowed = 3 * relative_error(baseline_weights[name], exact_weights[name]) + 2e-3
        assert relative_error(weight, exact_weights[name]) <= allowed, name


@pytest.mark.gpu
def test_gpu_gemma3_head_dim_256_bf16_step_is_within_the_unpatched_models_error(monkeypatch):
    """Gemma 3's real head dim (256) through the attention kernel at 512 tokens, windows of 128 on
    alternate layers, bf16 weights: the patched loss and every gradient no further from the fp32
    unpatched model than 1.5x the unpatched bf16 model's own error plus 1e-4 (the bound of
    `test_bf16_error_is_within_the_unpatched_models`). Not yet measured on a GPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    exact_model = tiny_model(
        "gemma3_text", layers=4, hidden=512, heads=8, head_dim=256, sliding_window=128, initializer_range=0.02
    ).cuda()
    ids = torch.randint(1, exact_model.config.vocab_size, (2, 512), device="cuda")
    exact = test_huggingface.step_values(exact_model.train(), ids, autocast=False)
    unpatched = copy.deepcopy(exact_model).bfloat16()
    patched = copy.deepcopy(unpatched)
    apply_fastlm(patched)
    baseline = test_huggingface.step_values(unpatched.train(), ids, autocast=False)
    values = test_huggingface.step_values(patched.train(), ids, autocast=False)
    names = ["loss"] + [name for name, _ in exact_model.named_parameters()]
    for name, value, reference, exact_value in zip(names, values, baseline, exact, strict=True):
        assert relative_error(value, exact_value) <= 1.5 * relative_error(reference, exact_value) + 1e-4, name
