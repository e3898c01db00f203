"""Depthwise causal conv1d kernels against F.conv1d (groups=D) in fp64: outputs, all gradients."""

import dataclasses

import pytest
import torch

import fastlm
from fastlm.ops import causal_conv1d as conv_module
from fastlm.ops.causal_conv1d import CausalConv1dFunction, causal_conv1d, causal_conv1d_config, causal_conv1d_ref

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64, unit_roundoff

# (output, gradients): how far fastlm's normwise error may pass that of causal_conv1d_ref (F.conv1d;
# float64: the truth). fp32: sums taken in other orders (dw and db over the sequence). 16-bit
# outputs: an eighth of the unit roundoff, as both compute in fp32 and round once, at different
# points. 16-bit gradients: half of it, as the backward stores dz = dout * silu'(z) in the input's
# dtype before du sums it (as PyTorch's own SiLU backward hands it on), where the reference's graph
# keeps it in fp32: one rounding more.
ALLOWANCE = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (unit_roundoff(torch.float16) / 8, unit_roundoff(torch.float16) / 2),
    torch.bfloat16: (unit_roundoff(torch.bfloat16) / 8, unit_roundoff(torch.bfloat16) / 2),
}


def _check(u, weight, bias=None, activation=None, *, backend="triton", config=None):
    """Output and every gradient against the reference, by `check_against_float64`; with
    ``config``, through the eager autograd.Function with that launch configuration."""
    out = check_against_float64(
        lambda u, w, b: (
            CausalConv1dFunction.apply(u, w, b, activation == "silu", backend, config)
            if config is not None
            else causal_conv1d(u, w, b, activation, backend=backend)
        ),
        lambda u, w, b: causal_conv1d_ref(u, w, b, activation),
        (u, weight, bias),
        *ALLOWANCE[u.dtype],
    )
    assert out.dtype == u.dtype
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_matches_grouped_conv1d(k, activation):
    u = torch.randn(2, 37, 19, requires_grad=True)  # odd length and width: partial tiles
    weight = torch.randn(19, k, requires_grad=True)
    bias = torch.randn(19, requires_grad=True)
    _check(u, weight, bias, activation)


def test_definition_by_hand():
    # out[l] = bias + w0 * u[l-2] + w1 * u[l-1] + w2 * u[l], zeros before the start
    u = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
    weight = torch.tensor([[10.0, 100.0, 1000.0]])
    out = causal_conv1d(u, weight, torch.tensor([0.5]))
    assert out.flatten().tolist() == [1000.5, 2100.5, 3210.5, 4320.5]
    assert fastlm.causal_conv1d is causal_conv1d


def test_backward_spans_chunks_and_frozen_parameters():
    # 3 chunks of 16 rows per sequence of 40 (the last partial), 2 steps of 8 per chunk; 8-channel
    # blocks over 12 channels (the second partial) in every kernel
    config = dataclasses.replace(
        conv_module.DEFAULT_CONFIG,
        backward_chunk_l=16,
        backward_block_l=8,
        backward_block_d=8,
        forward_block_l=16,
        forward_block_d=8,
    )
    u = torch.randn(2, 40, 12, requires_grad=True)
    _check(u, torch.randn(12, 4, requires_grad=True), torch.randn(12, requires_grad=True), "silu", config=config)
    _check(u, torch.randn(12, 4), torch.randn(12), "silu", config=config)  # frozen weight and bias: only du
    _check(u, torch.randn(12, 3, requires_grad=True), None, config=config)  # no bias
    _check(u, torch.randn(12, 3), None, config=config)  # no activation, frozen weight: du from dout alone


def test_config_checks_and_architectures():
    with pytest.raises(ValueError, match="backward_chunk_l .* must be a multiple of backward_block_l"):
        dataclasses.replace(conv_module.DEFAULT_CONFIG, backward_chunk_l=100, backward_block_l=64)
    # measured on sm90; any other architecture and the interpreter (0) get the default, never an error
    for arch in (0, 75, 80, 90, 100, 120):
        config = causal_conv1d_config(arch, torch.bfloat16)
        assert config.backward_chunk_l % config.backward_block_l == 0
    assert causal_conv1d_config(75, torch.float32) == conv_module.DEFAULT_CONFIG


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    u = torch.randn(2, 24, 16, dtype=dtype, requires_grad=True)
    _check(
        u, torch.randn(16, 4, dtype=dtype, requires_grad=True), torch.randn(16, dtype=dtype, requires_grad=True), "silu"
    )


def test_non_contiguous_input():
    base = torch.randn(2, 16, 30)
    u = base.transpose(1, 2).requires_grad_()  # (2, 30, 16), channels not unit-stride
    _check(u, torch.randn(16, 3, requires_grad=True), torch.randn(16, requires_grad=True))


def test_weight_gradient_is_deterministic():
    u = torch.randn(2, 40, 8, requires_grad=True)
    weight = torch.randn(8, 4, requires_grad=True)
    first = torch.autograd.grad(causal_conv1d(u, weight, None, "silu").sum(), weight)[0]
    second = torch.autograd.grad(causal_conv1d(u, weight, None, "silu").sum(), weight)[0]
    assert torch.equal(first, second)


def test_compiles_without_graph_breaks():
    u = torch.randn(2, 16, 8, requires_grad=True)
    weight = torch.randn(8, 4, requires_grad=True)

    def fn(u, weight):
        return causal_conv1d(u, weight, None, "silu").square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(u, weight), (u, weight))
    want = torch.autograd.grad(fn(u, weight), (u, weight))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype,k", [(torch.float16, 3), (torch.bfloat16, 4), (torch.float32, 8)])
def test_gpu_matches_reference(backend, dtype, k):
    u = torch.randn(2, 1000, 320, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(320, k, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(320, device="cuda", dtype=dtype, requires_grad=True)
    for activation in (None, "silu"):
        _check(u, weight, bias, activation, backend=backend)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    u = torch.randn(2, 300, 64, device="cuda", requires_grad=True)
    weight = torch.randn(64, 4, device="cuda", requires_grad=True)
    bias = torch.randn(64, device="cuda", requires_grad=True)
    out = compiled_code_launches(
        lambda u: causal_conv1d(u * 2, weight, bias, "silu"),
        (u,),
        kernels=("_conv1d_forward_kernel", "_conv1d_dz_kernel", "_conv1d_input_grad_kernel"),
        ops=("fastlm.causal_conv1d_forward", "fastlm.causal_conv1d_backward"),
    )
    expected = causal_conv1d_ref(u * 2, weight, bias, "silu")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad(expected.sum(), (u, weight, bias))
    for got, w in zip((u.grad, weight.grad, bias.grad), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_gpu_direct_launch_matches_tritons_dispatcher(monkeypatch):
    kernels = (conv_module._conv1d_forward_kernel, conv_module._conv1d_dz_kernel, conv_module._conv1d_input_grad_kernel)

    def forward_and_grads(u, weight, bias):
        out = causal_conv1d(u, weight, bias, "silu")
        return out, *torch.autograd.grad(out, (u, weight, bias), torch.ones_like(out).cumsum(1))

    def params(k):
        return torch.randn(40, k, device="cuda", requires_grad=True), torch.randn(40, device="cuda", requires_grad=True)

    forward_and_grads(torch.randn(2, 50, 40, device="cuda", requires_grad=True), *params(4))  # aligned binaries
    # u 4 bytes past a 16-byte boundary with odd strides; weight and bias read through their strides
    u = torch.randn(2 * 50 * 41 + 1, device="cuda")[1:].view(2, 50, 41)[..., :40].requires_grad_()
    table = torch.randn(40, 7, device="cuda")
    weight, bias = table[:, 1:5].requires_grad_(), table[:, 6].requires_grad_()
    assert_direct_launch_matches_dispatcher(lambda: forward_and_grads(u, weight, bias), kernels, monkeypatch)


@pytest.mark.gpu
def test_gpu_compiles_with_dynamic_shapes():
    # sizes are SymInts inside the traced launchers: nothing may hash them (the config caches)
    def fn(u, weight, bias):
        return causal_conv1d(u, weight, bias, "silu").square().sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    weight = torch.randn(64, 4, device="cuda", requires_grad=True)
    bias = torch.randn(64, device="cuda", requires_grad=True)
    for length in (300, 700):
        u = torch.randn(2, length, 64, device="cuda", requires_grad=True)
        got = torch.autograd.grad(compiled(u, weight, bias), (u, weight, bias))
        want = torch.autograd.grad(fn(u, weight, bias), (u, weight, bias))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3)


def test_ops_pass_opcheck():
    # what torch.compile relies on: tracing the ops gives the shapes and strides they return
    u, weight, bias = torch.randn(2, 12, 8), torch.randn(8, 3), torch.randn(8)
    torch.library.opcheck(conv_module._forward_op, (u, weight, bias, True))
    torch.library.opcheck(conv_module._backward_op, (torch.randn(2, 12, 8), u, weight, bias, True, True, True))


def test_strided_bias_and_weight():
    params = torch.randn(8, 6)
    weight, bias = params[:, 1:4], params[:, 4]  # weight with row stride 6, bias with stride 6
    _check(torch.randn(2, 10, 8, requires_grad=True), weight.requires_grad_(), bias.requires_grad_(), "silu")
