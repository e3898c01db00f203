"""`apply_fastlm(model, fp8=True)`: which linear layers run `fastlm.fp8_linear`, a training step
within FP8's error of the unpatched model's, autocast, revert. The rest of the patch runs on the
ops' reference paths (TRITON_INTERPRET unset): what these check is the wiring of the layers."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastlm.integrations.huggingface.fp8 as hf_fp8  # noqa: E402
import fastlm.layers.fp8 as fp8_layer  # noqa: E402
from fastlm.integrations.huggingface import apply_fastlm, revert_fastlm  # noqa: E402

from .test_huggingface import tiny_model, tokens  # noqa: E402


@pytest.fixture(autouse=True)
def reference_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def fp8_calls(monkeypatch):
    """The shapes of the weights each `fp8_linear` call took."""
    calls = []
    real = fp8_layer.fp8_linear

    def counted(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(fp8_layer, "fp8_linear", counted)
    return calls


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_decoder_linears_run_in_fp8_and_the_head_does_not(fp8_calls):
    model = tiny_model("llama")  # 2 layers: q, k, v, o, gate, up, down each
    apply_fastlm(model, fp8=True)
    ids = tokens(2, 16)
    model.train()(input_ids=ids, labels=ids).loss.backward()
    assert len(fp8_calls) == 2 * 7
    assert tuple(model.lm_head.weight.shape) not in fp8_calls


def test_the_routers_of_experts_stay_in_the_weights_dtype(fp8_calls):
    model = tiny_model("qwen3_moe", layers=1)
    converted = hf_fp8.fp8_layers(model)
    router = model.model.layers[0].mlp.gate
    assert converted and all(module is not router for module in converted)


def test_a_peft_models_adapters_and_adapted_head_stay_in_the_weights_dtype():
    """LoRA on the attention projections and on the LM head (r 16, a multiple of 16): the adapted
    projections' base layers convert, the adapters and everything inside the head do not."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=16, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama"), lora)
    converted = {id(module) for module in hf_fp8.fp8_layers(model.get_base_model())}
    named = dict(model.get_base_model().named_modules())
    assert id(named["model.layers.0.self_attn.q_proj.base_layer"]) in converted
    assert id(named["model.layers.0.self_attn.k_proj"]) in converted
    kept = [name for name in named if "lora_" in name or name.startswith("lm_head")]
    assert kept and not [name for name in kept if id(named[name]) in converted]


def test_a_training_step_is_within_fp8_error_of_the_unpatched_model():
    """Loss and gradients of every weight against the unpatched fp32 model: the loss within 2%
    (measured 0.08%), each gradient within 35% normwise and none equal (measured 11-25%: e5m2's 7%
    per rounding of each output gradient compounds through the backward's chain of matmuls)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_fastlm(model, fp8=True)
    ids = tokens(2, 16)
    losses = []
    for each in (model, reference):
        loss = each.train()(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert abs(float(losses[0] / losses[1]) - 1) < 0.02
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert 0 < _relative(param.grad, expected.grad) < 0.35, name


def test_autocast_gives_the_linears_bf16_inputs_and_outputs():
    model = tiny_model("llama")
    apply_fastlm(model, fp8=True)
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    ids = tokens(2, 16)
    with torch.autocast("cpu", torch.bfloat16):
        loss = model.train()(input_ids=ids, labels=ids).loss
    loss.backward()
    assert seen == [torch.bfloat16] and loss.isfinite()


def test_revert_and_reapplying_without_fp8_restore_the_linears(fp8_calls):
    model = tiny_model("llama")
    apply_fastlm(model, fp8=True)
    apply_fastlm(model)  # applying again reverts first: the switches given last hold
    ids = tokens(2, 16)
    model.train()(input_ids=ids, labels=ids)
    revert_fastlm(model)
    model(input_ids=ids, labels=ids)
    assert fp8_calls == [] and "forward" not in model.model.layers[0].mlp.down_proj.__dict__


def test_fp8_must_be_a_flag():
    with pytest.raises(TypeError, match="fp8 must be True or False"):
        apply_fastlm(tiny_model("llama"), fp8="yes")
