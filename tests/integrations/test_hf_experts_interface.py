"""The "fastlm" experts implementation of transformers' ExpertsInterface, without apply_fastlm:
a tiny Qwen3-MoE's loss and gradients against transformers' eager experts (fp32; the kernels
under the interpreter), and the layouts it hands to grouped_mm."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastlm.integrations.huggingface import register_experts  # noqa: E402
from fastlm.integrations.huggingface.experts import kernel_activation  # noqa: E402
from fastlm.ops import moe  # noqa: E402


def _tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def test_the_registered_implementation_trains_as_the_eager_experts(monkeypatch):
    assert register_experts() == "fastlm"
    eager = _tiny_qwen3_moe()
    model = copy.deepcopy(eager)
    model.set_experts_implementation("fastlm")
    calls = []
    monkeypatch.setattr(moe.experts, "MoEExpertsFunction", _Counted(moe.experts.MoEExpertsFunction, calls))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = eager(tokens, labels=tokens).loss
    actual = model(tokens, labels=tokens).loss
    assert calls == [1]  # the kernels ran, once for the one layer of experts
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    expected.backward()
    actual.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_layouts_the_kernels_do_not_compute_go_to_grouped_mm():
    experts = _tiny_qwen3_moe().model.layers[0].mlp.experts
    assert kernel_activation(experts) == "silu"
    experts.has_bias = True  # GPT-OSS's kind
    assert kernel_activation(experts) is None
    experts.has_bias, experts.config.hidden_act = False, "relu"
    assert kernel_activation(experts) is None


class _Counted:
    """Stands in for an autograd.Function class, counting its apply calls."""

    def __init__(self, function, calls: list) -> None:
        self.function, self.calls = function, calls

    def apply(self, *args):
        self.calls.append(1)
        return self.function.apply(*args)
