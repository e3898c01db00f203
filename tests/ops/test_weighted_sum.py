"""The template op: outputs and both gradients against the reference, compile, errors."""

import dataclasses

import pytest
import torch

from fastlm.ops import weighted_sum as template
from fastlm.ops.common import device_arch
from fastlm.ops.weighted_sum import WeightedSumFunction, weighted_sum, weighted_sum_config, weighted_sum_ref

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64

# How far fastlm's normwise error may pass that of weighted_sum_ref (float64: the truth), output and
# gradients alike: fp32 sums over D (the output) and over the rows (dw) taken in other orders.
ALLOWANCE = 1e-6


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 33, 100), (40, 2000)])  # partial row and column blocks
def test_matches_reference_with_gradients(shape):
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    check_against_float64(weighted_sum, weighted_sum_ref, (x, w), ALLOWANCE)


def test_frozen_weight_and_non_contiguous_input():
    x = torch.randn(8, 6).t().requires_grad_()  # (6, 8), column stride 6
    w = torch.randn(8)
    (grad,) = torch.autograd.grad(weighted_sum(x, w).sum(), x)
    torch.testing.assert_close(grad, w.expand(6, 8))


def test_weight_gradient_is_deterministic():
    x, w = torch.randn(100, 64), torch.randn(64, requires_grad=True)
    first = torch.autograd.grad(weighted_sum(x, w).sum(), w)[0]
    assert torch.equal(first, torch.autograd.grad(weighted_sum(x, w).sum(), w)[0])
    # several programs, so the partials are really summed
    assert weighted_sum_config(device_arch(x.device), x.dtype).block_rows < 100


@pytest.mark.parametrize("weight_grad", [True, False])
def test_explicit_config_loops_over_columns(weight_grad):
    # 4-wide column steps over D = 13 (the last one partial), 4 rows per program over R = 10 (the
    # last program has 2); without the weight gradient the kernel writes no partials
    config = dataclasses.replace(template.DEFAULT_CONFIG, block_rows=4, block_d_max=4)
    x = torch.randn(10, 13, requires_grad=True)
    w = torch.randn(13, requires_grad=weight_grad)
    check_against_float64(lambda x, w: WeightedSumFunction.apply(x, w, config), weighted_sum_ref, (x, w), ALLOWANCE)


def test_config_for_every_architecture():
    # measured on sm90; any other architecture and the interpreter (0) get the default, never an error
    for arch in (0, 75, 80, 90, 100, 120):
        config = weighted_sum_config(arch, torch.bfloat16)
        assert all(n >= 1 and n & (n - 1) == 0 for n in (config.block_rows, config.block_d_max))  # powers of two
    assert weighted_sum_config(75, torch.float32) == template.DEFAULT_CONFIG
    # BLOCK_D: the next power of two up to block_d_max; D = 0 still gets a valid block
    assert [template.DEFAULT_CONFIG.block_d(d) for d in (0, 1, 5, 1024, 3000)] == [1, 1, 8, 1024, 1024]
    with pytest.raises(dataclasses.FrozenInstanceError):
        template.DEFAULT_CONFIG.block_rows = 1  # type: ignore[misc]


def test_compiles_without_graph_breaks():
    x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    compiled = torch.compile(lambda x, w: weighted_sum(x, w).square().sum(), fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w), (x, w))
    want = torch.autograd.grad(weighted_sum_ref(x, w).square().sum(), (x, w))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.gpu
def test_gpu_matches_reference():
    x = torch.randn(4096, 3000, device="cuda", requires_grad=True)
    w = torch.randn(3000, device="cuda", requires_grad=True)
    check_against_float64(weighted_sum, weighted_sum_ref, (x, w), ALLOWANCE)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    x = torch.randn(512, 300, device="cuda", requires_grad=True)
    w = torch.randn(300, device="cuda", requires_grad=True)

    def doubled(x, w):
        return weighted_sum(x, w) * 2

    compiled_code_launches(
        doubled,
        (x, w),
        kernels=("_weighted_sum_forward_kernel", "_weighted_sum_backward_kernel"),
        ops=("fastlm.weighted_sum_forward", "fastlm.weighted_sum_backward"),
    )
    check_against_float64(
        torch.compile(doubled, fullgraph=True), lambda x, w: weighted_sum_ref(x, w) * 2, (x, w), ALLOWANCE
    )


@pytest.mark.gpu
def test_gpu_direct_launch_matches_tritons_dispatcher(monkeypatch):
    kernels = (template._weighted_sum_forward_kernel, template._weighted_sum_backward_kernel)
    dy = torch.randn(37, device="cuda")

    def forward_and_grads(x, w):
        out = weighted_sum(x, w)
        return (out, *torch.autograd.grad(out, (x, w), dy))

    aligned = torch.randn(37, 60, device="cuda", requires_grad=True), torch.randn(60, device="cuda", requires_grad=True)
    forward_and_grads(*aligned)  # the aligned binaries, cached first: they must not serve the inputs below
    # x 4 bytes past a 16-byte boundary with row stride 61, w with stride 2: specializations of their own
    x = torch.randn(37 * 61 + 1, device="cuda")[1:].view(37, 61)[:, :60].requires_grad_()
    w = torch.randn(120, device="cuda")[::2].requires_grad_()
    assert_direct_launch_matches_dispatcher(lambda: forward_and_grads(x, w), kernels, monkeypatch)


@pytest.mark.gpu
def test_gpu_compiles_with_dynamic_shapes():
    # sizes are SymInts inside the traced launchers: nothing may hash them (the config caches)
    compiled = torch.compile(lambda x, w: weighted_sum(x, w).square().sum(), fullgraph=True, dynamic=True)
    for rows in (64, 100):
        x = torch.randn(rows, 96, device="cuda", requires_grad=True)
        w = torch.randn(96, device="cuda", requires_grad=True)
        got = torch.autograd.grad(compiled(x, w), (x, w))
        want = torch.autograd.grad(weighted_sum_ref(x, w).square().sum(), (x, w))
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-3)


def test_ops_pass_opcheck():
    x, w = torch.randn(5, 7), torch.randn(7)
    torch.library.opcheck(template._forward_op, (x, w))
    torch.library.opcheck(template._backward_op, (torch.randn(5), x, w))


def test_strided_weight_and_empty_rows():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(8, 2)[:, 0].requires_grad_()  # stride 2, read through its stride (no copy)
    dy = torch.randn(12)[::2]  # an upstream gradient with stride 2
    out = weighted_sum(x, w)
    torch.testing.assert_close(out, weighted_sum_ref(x, w))
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    torch.testing.assert_close(dx, dy[:, None] * w.detach())
    torch.testing.assert_close(dw, dy @ x.detach())
    assert weighted_sum(torch.randn(3, 0), torch.randn(0)).tolist() == [0.0, 0.0, 0.0]


def test_no_rows():
    # R = 0: no program runs, so dw (a sum over no rows) must still come out as zeros
    x, w = torch.randn(0, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    out = weighted_sum(x, w)
    dx, dw = torch.autograd.grad(out, (x, w), torch.randn(0))
    assert out.shape == (0,) and dx.shape == (0, 5) and dw.tolist() == [0.0] * 5
