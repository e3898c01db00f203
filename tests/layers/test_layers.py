"""The layers' two rules (when a fused kernel runs, what dtype it writes) and each layer's kernel
path against its PyTorch path."""

import pytest
import torch

from fastlm.layers import LayerNorm, LMHeadLoss, RMSNorm, SwiGLUMLP
from fastlm.layers.linear import Linear
from fastlm.layers.loss import lm_head_loss
from fastlm.layers.mlp import GATED_ACTIVATIONS, gated_activation
from fastlm.layers.rules import kernel_output_dtype, runs_kernel


def test_runs_kernel_steps_aside_under_compile_only_for_auto():
    seen = {}

    def probe(x):
        seen.update({switch: runs_kernel(switch) for switch in ("torch", "fastlm", "auto")})
        return x + 1

    probe(torch.ones(1))
    assert seen == {"torch": False, "fastlm": True, "auto": True}
    torch._dynamo.reset()
    torch.compile(probe, backend="eager", fullgraph=True)(torch.ones(1))
    assert seen == {"torch": False, "fastlm": True, "auto": False}


def test_kernel_output_dtype_is_autocasts_else_the_promotion():
    x, weight = torch.randn(2, 4, dtype=torch.bfloat16), torch.ones(4)
    assert kernel_output_dtype(x) == torch.bfloat16
    assert kernel_output_dtype(x, weight) == torch.float32  # as weight * normed in PyTorch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert kernel_output_dtype(x.float(), weight) == torch.bfloat16


@pytest.mark.parametrize("layer", [RMSNorm, LayerNorm])
def test_norm_kernel_and_torch_paths_agree(layer):
    x = torch.randn(3, 5, 24, requires_grad=True)
    fused, plain = layer(24, eps=1e-6), layer(24, eps=1e-6, kernel="torch")
    with torch.no_grad():
        fused.weight.uniform_(0.5, 1.5)
    plain.load_state_dict(fused.state_dict())
    upstream = torch.randn(3, 5, 24)
    grads = []
    for module in (fused, plain):
        x.grad = None
        y = module(x)
        y.backward(upstream)
        grads.append((y, x.grad.clone(), module.weight.grad))
    for got, expected in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_norm_layers_check_their_arguments():
    with pytest.raises(ValueError, match="kernel must be one of torch, fastlm, auto, got 'apex'"):
        RMSNorm(8, kernel="apex")
    with pytest.raises(ValueError, match="kernel must be one of torch, fastlm, got 'auto'"):
        LMHeadLoss("auto")
    assert RMSNorm(8, elementwise_affine=False).weight is None


def test_swiglu_mlp_kernel_and_torch_paths_agree():
    x = torch.randn(2, 3, 16, requires_grad=True)
    fused, plain = SwiGLUMLP(16, 40), SwiGLUMLP(16, 40, kernel="torch")
    plain.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-6)
    fused(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
def test_gated_activation_kernel_and_torch_paths_agree(activation):
    # the halves of one fused projection, as a gate_up_proj hands them over
    gate, up = torch.randn(2, 3, 2 * 16).chunk(2, dim=-1)
    gate, up = gate.requires_grad_(), up.requires_grad_()
    outs = [gated_activation(gate, up, activation, kernel) for kernel in ("fastlm", "torch")]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad(out.square().sum(), (gate, up)) for out in outs]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lm_head_loss_kernel_and_torch_paths_agree(reduction):
    head = Linear(16, 50)
    hidden, targets = torch.randn(2, 7, 16), torch.randint(0, 50, (2, 7))
    targets[0, 3] = -100  # ignored by both
    losses = [LMHeadLoss(kernel, reduction=reduction)(hidden, head, targets) for kernel in ("fastlm", "torch")]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)


def test_lm_head_loss_softcaps_the_logits_on_both_paths():
    head = Linear(16, 50)
    hidden, targets = torch.randn(14, 16), torch.randint(0, 50, (14,))
    capped = torch.nn.functional.cross_entropy(torch.tanh(head(hidden) / 0.5) * 0.5, targets)
    for kernel in ("fastlm", "torch"):
        torch.testing.assert_close(lm_head_loss(hidden, head, targets, kernel=kernel, softcap=0.5), capped)
    assert not torch.allclose(lm_head_loss(hidden, head, targets), capped)
