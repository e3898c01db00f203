"""fastlm's model as a mixture of experts: the config, the MoE blocks, the routers' losses and
totals, and `fastlm train` on one (CPU; the fastlm kernels under the interpreter)."""

import dataclasses

import pytest
import torch

from fastlm.analysis.model import flops_per_token
from fastlm.layers.moe import MoEMLP
from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.materialize import materialize
from fastlm.ops.moe import expert_counts, load_balancing_loss, router_z_loss
from fastlm.train import loop
from fastlm.train.log import format_record, read_log

TINY_MOE = ModelConfig.preset("tiny-moe", vocab_size=97, context_length=16)


def _tokens(batch=2, length=16, seed=0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Config and parameter counts
# ---------------------------------------------------------------------------------------------


def test_a3b_moe_has_qwen3_30b_a3bs_expert_layer():
    config = ModelConfig.preset("a3b-moe")
    assert (config.d_model, config.num_experts, config.experts_per_token, config.expert_width) == (2048, 128, 8, 768)
    # per token: attention 4 d^2, router E d, 8 experts' 3 d I: about 3.3% of the experts' weights active
    active, total = config.num_matmul_parameters(active=True), config.num_matmul_parameters()
    head = config.d_model * config.vocab_size
    assert active - head == 4 * (4 * 2048**2 + 128 * 2048 + 8 * 3 * 2048 * 768)
    assert total - head == 4 * (4 * 2048**2 + 128 * 2048 + 128 * 3 * 2048 * 768)


def test_moe_every_alternates_dense_and_expert_blocks_and_shared_experts_add_a_dense_mlp():
    config = dataclasses.replace(TINY_MOE, num_layers=4, moe_every=2, shared_experts=1)
    model = TransformerLM(config)
    assert config.moe_layers == [1, 3]
    assert [isinstance(block.ffn, MoEMLP) for block in model.blocks] == [False, True, False, True]
    assert model.blocks[1].ffn.shared.w1.weight.shape == (config.expert_width, config.d_model)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    dense = dataclasses.replace(config, num_experts=0)
    assert flops_per_token(dense, "fwd") < flops_per_token(config, "fwd")  # a shared expert and 2 routed
    assert TransformerLM(dense).router_totals is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"experts_per_token": 5}, r"experts_per_token \(5\) must be at most num_experts \(4\)"),
        ({"num_experts": -1}, "num_experts must be an integer >= 0"),
        ({"moe_every": 0}, "moe_every must be a positive integer"),
        ({"expert_d_ff": 0}, "expert_d_ff must be a positive integer or None"),
        ({"router_aux_coef": -0.1}, "router_aux_coef must be a number >= 0"),
    ],
)
def test_bad_expert_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY_MOE, **fields)


def test_a_meta_model_materializes_to_the_constructors_values():
    torch.manual_seed(5)
    built = TransformerLM(TINY_MOE)
    with torch.device("meta"):
        model = TransformerLM(TINY_MOE)
    torch.manual_seed(5)
    materialize(model, torch.device("cpu"))
    expected = built.state_dict()
    assert set(model.state_dict()) == set(expected)  # the router totals are not state
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


# ---------------------------------------------------------------------------------------------
# The routers' losses
# ---------------------------------------------------------------------------------------------


def test_load_balancing_loss_is_transformers_for_one_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(37, 6, generator=torch.Generator().manual_seed(1))
    index = torch.topk(logits.softmax(-1), 2, dim=-1).indices
    expected = load_balancing_loss_func((logits,), num_experts=6, top_k=2)
    torch.testing.assert_close(load_balancing_loss(logits, index), expected)


def test_load_balancing_loss_is_k_when_balanced_and_k_e_when_one_expert_takes_all():
    uniform = torch.zeros(8, 4)
    index = torch.tensor([[0, 1], [2, 3]] * 4)
    assert load_balancing_loss(uniform, index).item() == pytest.approx(2.0)
    collapsed = torch.tensor([[30.0, 0, 0, 0]] * 8)
    assert load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(4.0)


def test_z_loss_and_counts():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    expected = (torch.log(torch.tensor(2.0)) ** 2 + torch.logsumexp(torch.tensor([1.0, -1.0]), 0) ** 2) / 2
    torch.testing.assert_close(router_z_loss(logits), expected)
    index = torch.tensor([[0, 3], [3, 7], [-1, 3]])  # 7 and -1 are outside the 4 experts
    assert expert_counts(index, 4).tolist() == [1, 0, 0, 3]
    with pytest.raises(ValueError, match=r"top_k_index must be \(T, K\) with T = 2"):
        load_balancing_loss(logits, index)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def _loss_and_grads(config, tokens):
    torch.manual_seed(0)
    model = TransformerLM(config)
    loss = model(tokens, tokens)
    loss.backward()
    return model, loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_fastlm_experts_train_as_pytorchs_loop_does():
    tokens, one_block = _tokens(batch=1), dataclasses.replace(TINY_MOE, num_layers=1)  # the interpreter is slow
    _, torch_loss, torch_grads = _loss_and_grads(one_block.with_kernels("torch"), tokens)
    _, fastlm_loss, fastlm_grads = _loss_and_grads(one_block.with_kernels("torch", mlp="fastlm"), tokens)
    torch.testing.assert_close(fastlm_loss, torch_loss, rtol=1e-5, atol=1e-5)
    for name, grad in torch_grads.items():
        torch.testing.assert_close(fastlm_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_training_adds_the_router_loss_and_totals_it_evaluation_does_not():
    tokens = _tokens()
    config = TINY_MOE.with_kernels("torch")
    model, loss, _ = _loss_and_grads(config, tokens)
    free = TransformerLM(dataclasses.replace(config, router_aux_coef=0.0))
    free.load_state_dict(model.state_dict())
    lm_loss = free(tokens, tokens).detach()
    totals = model.router_totals.take()
    fields = model.router_totals.fields(totals.tolist())
    assert fields["router_loss"] == pytest.approx((loss - lm_loss).item(), rel=1e-4)
    assert fields["router_loss"] == pytest.approx(0.01 * fields["aux_loss"], rel=1e-5)
    assert 2 <= fields["aux_loss"] <= 2 * 4  # K balanced .. K E collapsed
    counts = totals[2 : 2 + 2 * 4].view(2, 4)
    assert counts.sum(dim=1).tolist() == [2 * 16 * 2] * 2  # every (token, choice) of each MoE block
    assert fields["expert_load"] == pytest.approx((counts.max(dim=1).values / counts.mean(dim=1)).tolist())
    assert model.router_totals.take().abs().sum() == 0  # taken: back at zero
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, tokens), lm_loss)  # held-out loss: the LM's alone
    assert model.router_totals.take().abs().sum() == 0


def test_recompute_gives_the_same_gradients_and_counts_each_forward_once():
    tokens = _tokens()
    config = TINY_MOE.with_kernels("torch")
    plain, plain_loss, plain_grads = _loss_and_grads(config, tokens)
    again, again_loss, again_grads = _loss_and_grads(dataclasses.replace(config, recompute=True), tokens)
    torch.testing.assert_close(again_loss, plain_loss)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(again_grads[name], grad, msg=name)
    torch.testing.assert_close(again.router_totals.take(), plain.router_totals.take())


def test_the_experts_compile_with_their_kernels():
    config = dataclasses.replace(TINY_MOE, num_layers=1).with_kernels("torch", mlp="fastlm")
    tokens = _tokens()
    _, eager_loss, eager_grads = _loss_and_grads(config, tokens)
    torch.manual_seed(0)
    model = TransformerLM(config)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(tokens, tokens)
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager_loss, rtol=1e-5, atol=1e-5)
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert model.router_totals.take()[-1].item() == 1  # the compiled forward counted itself


# ---------------------------------------------------------------------------------------------
# fastlm train
# ---------------------------------------------------------------------------------------------


def test_fastlm_train_logs_the_routers_and_plots_the_expert_load(corpus_data, tmp_path, capsys):
    argv = ["--data", str(corpus_data), "--preset", "tiny-moe", "--context", "16", "--micro-batch", "4"]
    argv += ["--steps", "4", "--log-every", "2", "--eval-sequences", "4", "--out", str(tmp_path)]
    assert loop.main([*argv, "--experts", "3", "--shared-experts", "1"]) == 0
    records = [r for r in read_log(tmp_path / "log.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["router_loss"] == pytest.approx(0.01 * record["aux_loss"], rel=1e-5)
        assert 2 <= record["aux_loss"] <= 6 and len(record["expert_load"]) == 2
        assert all(1 <= load <= 3 for load in record["expert_load"])
    assert "| aux loss " in capsys.readouterr().out and (tmp_path / "experts.png").stat().st_size > 0
    line = format_record({"step": 2, "loss": 5.0, "aux_loss": 2.1, "expert_load": [1.25, None]}, 4)
    assert line == "step 2/4 | loss 5.0000 | aux loss 2.100 | busiest expert 1.25x the mean"


def test_fastlm_train_refuses_more_experts_per_token_than_experts(corpus_data, tmp_path, capsys):
    argv = ["--data", str(corpus_data), "--preset", "tiny-moe", "--experts-per-token", "5", "--out", str(tmp_path)]
    assert loop.main(argv) == 2
    assert "--experts-per-token (5) must be at most --experts (4)" in capsys.readouterr().err
