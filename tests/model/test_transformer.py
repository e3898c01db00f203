"""The language model: shapes, parameter counts, causality, RoPE, kernel switches, training."""

import contextlib
import dataclasses
import importlib
import math

import pytest
import torch

from fastlm.analysis.model import flops_per_token
from fastlm.layers import Linear, MoEMLP, RotaryEmbedding
from fastlm.model import PRESETS, ModelConfig, TransformerLM

TINY = ModelConfig.preset("tiny", vocab_size=97, context_length=32)
KERNEL_COMBINATIONS = [
    (attention, norm, loss, "torch")
    for attention in ("naive", "sdpa", "fastlm")
    for norm in ("torch", "fastlm", "auto")
    for loss in ("torch", "fastlm")
] + [("naive", "torch", "torch", "fastlm"), ("naive", "fastlm", "fastlm", "fastlm")]  # the fused softmax


def tokens(batch=2, length=24, vocab=TINY.vocab_size):
    return torch.randint(0, vocab, (batch, length))


def assert_same_gradients(model, reference, rtol, atol):
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=name)


def assert_same_loss_and_gradients(model, reference, x, y, loss_tol, grad_tol, forward=None, bf16=False):
    """From ``reference``'s weights: ``model``'s loss (through ``forward``, e.g. its compiled form)
    and every parameter gradient against ``reference``'s; ``bf16`` runs both under autocast."""
    model.load_state_dict(reference.state_dict())
    autocast = torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        expected, actual = reference(x, y), (model if forward is None else forward)(x, y)
    torch.testing.assert_close(actual, expected, rtol=loss_tol[0], atol=loss_tol[1])
    expected.backward()
    actual.backward()
    assert_same_gradients(model, reference, *grad_tol)


def test_logits_shape_and_dtype():
    model = TransformerLM(TINY)
    logits = model(tokens(3, 17))
    assert logits.shape == (3, 17, TINY.vocab_size)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("name", PRESETS)
def test_parameter_count_matches_the_modules(name):
    config = ModelConfig.preset(name)
    with torch.device("meta"):  # counts shapes without allocating 10B parameters
        model = TransformerLM(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    matmul += sum(m.gate_up.numel() + m.down.numel() for m in model.modules() if isinstance(m, MoEMLP))
    assert matmul == config.num_matmul_parameters()


def test_small_preset_parameter_count_by_hand():
    # 12 blocks x (4*768^2 attention + 3*768*3072 SwiGLU + 2*768 norms) + 768 + 768*10000 head + embedding
    expected = 12 * (4 * 768**2 + 3 * 768 * 3072 + 1536) + 768 + 2 * 7_680_000
    assert ModelConfig.preset("small").num_parameters() == expected == 128_625_408


def test_initialization_statistics():
    model = TransformerLM(ModelConfig.preset("tiny", d_model=256, d_ff=512, vocab_size=1000))
    w = model.blocks[0].ffn.w1.weight  # (512, 256): std sqrt(2 / 768)
    std = math.sqrt(2 / (256 + 512))
    assert w.std().item() == pytest.approx(std * 0.986, rel=0.03)  # truncation at 3 std shrinks std by 1.4%
    assert w.abs().max().item() <= 3 * std
    assert model.embedding.weight.std().item() == pytest.approx(0.986, rel=0.03)
    assert model.embedding.weight.abs().max().item() <= 3.0
    assert not any("bias" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("attention", ["naive", "sdpa", "fastlm"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(attention):
    model = TransformerLM(TINY.with_kernels(attention=attention))
    x = tokens(1, 20)
    changed = x.clone()
    changed[0, 12] = (x[0, 12] + 1) % TINY.vocab_size
    before, after = model(x), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


@pytest.mark.parametrize("kernel", ["torch", "fastlm"])
def test_rope_preserves_norms_and_depends_only_on_relative_position(kernel):
    rope = RotaryEmbedding(head_dim=16, context_length=64, theta=10000.0, kernel=kernel)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def at(vector, position):  # rotate `vector` as if it sat at `position`
        x = torch.zeros(1, 1, 64, 16)
        x[0, 0, position] = vector.float()
        return rope(x, x)[0][0, 0, position].double()

    torch.testing.assert_close(at(q, 0), q, rtol=1e-6, atol=1e-6)  # position 0: identity
    torch.testing.assert_close(at(q, 37).norm(), q.norm(), rtol=1e-6, atol=0)
    dots = [at(q, m) @ at(k, m - 5) for m in (5, 20, 63)]
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["torch", "fastlm"])
def test_rope_keeps_dtype(kernel):
    rope = RotaryEmbedding(head_dim=8, context_length=16, theta=10000.0, kernel=kernel)
    x = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    assert [t.dtype for t in rope(x, x)] == [torch.bfloat16] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_cast_to_another_dtype_keeps_its_rope(dtype):
    # the cast rounds the cos / sin buffers too; the kernel takes them back in fp32, and float64,
    # which it does not take, runs the PyTorch ops
    x = tokens()
    losses = []
    for rope in ("torch", "fastlm"):
        torch.manual_seed(0)
        losses.append(TransformerLM(TINY.with_kernels(rope=rope)).to(dtype)(x, x))
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)


@pytest.mark.parametrize("rope", ["fastlm", "auto"])
def test_rope_switch_gives_the_same_loss_and_gradients(rope):
    reference = TransformerLM(TINY)
    model = TransformerLM(TINY.with_kernels("fastlm", rope=rope))
    assert_same_loss_and_gradients(model, reference, tokens(), tokens(), (1e-5, 1e-5), (1e-4, 1e-5))


@pytest.mark.parametrize(("attention", "norm", "loss", "softmax"), KERNEL_COMBINATIONS)
def test_kernel_switches_give_the_same_loss_and_gradients(attention, norm, loss, softmax):
    reference = TransformerLM(TINY)
    model = TransformerLM(TINY.with_kernels(attention=attention, norm=norm, loss=loss, softmax=softmax))
    assert_same_loss_and_gradients(model, reference, tokens(), tokens(), (1e-5, 1e-5), (1e-4, 1e-5))


@pytest.mark.parametrize(
    ("attention", "norm"), [pytest.param("sdpa", "auto", marks=pytest.mark.slow), ("fastlm", "fastlm")]
)
def test_fastlm_kernels_compile_to_one_graph_with_the_same_loss_and_gradients(attention, norm):
    # every fastlm op traced by torch.compile (on CPU through the ops' PyTorch path), under autocast
    # so the norms write bf16 for the Linear layers that follow; one block: each op once is the point
    config = dataclasses.replace(TINY, num_layers=1)
    reference = TransformerLM(config)
    model = TransformerLM(config.with_kernels("fastlm", attention=attention, norm=norm))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x, y = tokens(), tokens()
    assert_same_loss_and_gradients(model, reference, x, y, (2e-2, 2e-2), (5e-2, 5e-3), compiled, bf16=True)


def test_fastlm_kernel_set_fuses_the_softmax_too():
    fastlm, torch_set = TINY.with_kernels("fastlm").kernels, TINY.with_kernels("torch").kernels
    assert fastlm.softmax == "fastlm" and torch_set.softmax == "torch"
    assert fastlm.mlp == "auto" and torch_set.mlp == "torch"


@pytest.mark.parametrize(
    ("switch", "module", "function", "per_forward"),
    [
        ("norm", "norms", "rms_norm", 2 * TINY.num_layers + 1),  # two per block and the final norm
        ("rope", "rotary", "rotary_embedding", TINY.num_layers),  # q and k of each block in one call
        ("mlp", "mlp", "swiglu", TINY.num_layers),
    ],
)
def test_auto_switches_run_the_kernel_in_eager_mode_and_torch_ops_when_compiled(
    monkeypatch, switch, module, function, per_forward
):
    layer_module = importlib.import_module(f"fastlm.layers.{module}")
    calls = []
    real = getattr(layer_module, function)
    monkeypatch.setattr(layer_module, function, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    model = TransformerLM(TINY.with_kernels(**{switch: "auto"}))
    x = tokens()
    model(x)
    assert len(calls) == per_forward
    calls.clear()
    torch._dynamo.reset()
    torch.compile(model, backend="eager", fullgraph=True)(x)  # traced, not generated: fast
    assert calls == []


@pytest.mark.parametrize("mlp", ["fastlm", "auto"])
def test_mlp_switch_gives_the_same_loss_and_gradients(mlp):
    reference = TransformerLM(TINY)
    model = TransformerLM(TINY.with_kernels(mlp=mlp))
    assert_same_loss_and_gradients(model, reference, tokens(), tokens(), (1e-5, 1e-5), (1e-4, 1e-5))


@pytest.mark.parametrize("loss", ["torch", "fastlm"])
def test_fused_loss_never_materializes_the_logits(loss):
    """loss="fastlm" computes the LM head's matmul inside fastlm.linear_cross_entropy, chunk by
    chunk: the head module never runs (no (B, N, V) logits) when targets are given; without targets
    it returns the logits either way."""
    model = TransformerLM(TINY.with_kernels(loss=loss))
    head_calls = []
    model.lm_head.register_forward_hook(lambda module, args, output: head_calls.append(output.shape))
    x = tokens(2, 8)
    model(x, tokens(2, 8))
    assert head_calls == ([] if loss == "fastlm" else [(2, 8, TINY.vocab_size)])
    assert model(x).shape == (2, 8, TINY.vocab_size)


def test_a_few_training_steps_reduce_the_loss():
    model = TransformerLM(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(4, 32)
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(15):
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 65}, "divisible by num_heads"),
        ({"d_model": 12, "num_heads": 4}, "must be even for RoPE"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ],
)
def test_bad_configs_raise_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **overrides)


@pytest.mark.parametrize(
    ("switches", "message"),
    [
        ({"attention": "flash"}, "attention must be one of naive, sdpa, fastlm"),
        ({"norm": "apex"}, "norm must be one of"),
        ({"mlp": "liger"}, "mlp must be one of torch, fastlm, auto"),
    ],
)
def test_bad_kernel_switches_raise_one_clear_error(switches, message):
    with pytest.raises(ValueError, match=message):
        TINY.with_kernels(**switches)
    with pytest.raises(ValueError, match="kernels must be one of torch, fastlm"):
        TINY.with_kernels("liger")
    with pytest.raises(TypeError, match="kernels must be a fastlm.settings.Kernels"):
        dataclasses.replace(TINY, kernels="fastlm")


def test_bad_inputs_raise_clear_errors():
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="exceeds context_length 32"):
        model(tokens(1, 33))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="targets shape"):
        model(tokens(2, 8), tokens(2, 7))
    vocab = TINY.vocab_size
    for bad in (vocab, -1):  # one past the last id, and a negative one: refused before the embedding
        ids = tokens(2, 8)
        ids[1, 3] = bad
        with pytest.raises(ValueError, match=rf"tokens must be ids in \[0, {vocab}\) \(vocab_size\), got {bad}$"):
            model(ids)


def test_flops_per_token_by_hand():
    config = ModelConfig.preset("small")
    n = config.num_matmul_parameters()
    assert flops_per_token(config, "fwd") == 2 * n + 2 * 12 * 512 * 768
    assert flops_per_token(config, "train") == 3 * flops_per_token(config, "fwd")
    assert flops_per_token(config, "fwd+bwd", seq_len=128) == 6 * n + 6 * 12 * 128 * 768


GPU_CONFIG = ModelConfig.preset("tiny", d_model=256, d_ff=704, num_heads=4, vocab_size=5000, context_length=256)


@pytest.mark.gpu
def test_gpu_fastlm_kernels_compile_to_one_graph():
    # the Triton path (wrap_triton launches, the loss as a custom op) traced on CUDA without a graph
    # break, under bf16 autocast, with the loss and gradients of the PyTorch-kernel model
    reference = TransformerLM(GPU_CONFIG).cuda()
    model = TransformerLM(GPU_CONFIG.with_kernels("fastlm")).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x, y = tokens(4, 256, 5000).cuda(), tokens(4, 256, 5000).cuda()
    assert_same_loss_and_gradients(model, reference, x, y, (2e-2, 2e-2), (5e-2, 5e-3), compiled, bf16=True)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "fastlm"])
def test_bf16_loss_parity_with_fastlm_kernels_on_gpu(attention):
    config = GPU_CONFIG
    reference = TransformerLM(config).cuda()
    model = TransformerLM(config.with_kernels(attention=attention, norm="fastlm", loss="fastlm")).cuda()
    x, y = tokens(4, 256, 5000).cuda(), tokens(4, 256, 5000).cuda()
    assert_same_loss_and_gradients(model, reference, x, y, (2e-3, 2e-3), (5e-2, 5e-3), bf16=True)


@pytest.mark.parametrize("attention", ["sdpa", "fastlm"])
def test_recompute_gives_the_same_loss_and_gradients(attention):
    """Activation checkpointing runs each block's forward again in backward: the same numbers."""
    reference = TransformerLM(TINY.with_kernels(attention=attention))
    model = TransformerLM(dataclasses.replace(TINY.with_kernels(attention=attention), recompute=True))
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    x = tokens(2, 16)
    assert_same_loss_and_gradients(model, reference, x, torch.roll(x, -1, 1), (0, 0), (0, 0))
    assert len(calls) == 2  # the forward, and again in backward
