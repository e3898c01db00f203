"""The template op: outputs and both gradients against the reference, compile, errors."""

import pytest
import torch

from fastlm.ops import weighted_sum as template
from fastlm.ops.weighted_sum import weighted_sum, weighted_sum_ref

from .reference import compiled_code_launches


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 33, 100), (40, 2000)])  # partial row and column blocks
def test_matches_reference_with_gradients(shape):
    x = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(shape[-1], requires_grad=True)
    out = weighted_sum(x, w)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expected = weighted_sum_ref(x64, w64)
    expected_grads = torch.autograd.grad(expected, (x64, w64), dy.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_frozen_weight_and_non_contiguous_input():
    x = torch.randn(8, 6).t().requires_grad_()  # (6, 8), column stride 6
    w = torch.randn(8)
    (grad,) = torch.autograd.grad(weighted_sum(x, w).sum(), x)
    torch.testing.assert_close(grad, w.expand(6, 8))


def test_weight_gradient_is_deterministic():
    x, w = torch.randn(100, 64), torch.randn(64, requires_grad=True)
    first = torch.autograd.grad(weighted_sum(x, w).sum(), w)[0]
    assert torch.equal(first, torch.autograd.grad(weighted_sum(x, w).sum(), w)[0])
    assert template.BLOCK_ROWS < 100  # several programs, so the partials are really summed


def test_compiles_without_graph_breaks():
    x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    compiled = torch.compile(lambda x, w: weighted_sum(x, w).square().sum(), fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, w), (x, w))
    want = torch.autograd.grad(weighted_sum_ref(x, w).square().sum(), (x, w))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="w must have shape"):
        weighted_sum(torch.randn(3, 4), torch.randn(5))
    with pytest.raises(TypeError, match="x must have dtype"):
        weighted_sum(torch.ones(3, 4, dtype=torch.int32), torch.randn(4))


@pytest.mark.gpu
def test_gpu_matches_reference():
    x = torch.randn(4096, 3000, device="cuda", requires_grad=True)
    w = torch.randn(3000, device="cuda", requires_grad=True)
    out = weighted_sum(x, w)
    torch.testing.assert_close(out, weighted_sum_ref(x, w), rtol=1e-4, atol=1e-3)
    (dw,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(dw, x.detach().sum(0), rtol=1e-4, atol=1e-2)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    x = torch.randn(512, 300, device="cuda", requires_grad=True)
    w = torch.randn(300, device="cuda", requires_grad=True)
    out = compiled_code_launches(lambda x, w: weighted_sum(x, w) * 2, (x, w),
                                 kernels=("_weighted_sum_forward_kernel", "_weighted_sum_backward_kernel"),
                                 ops=("fastlm.weighted_sum_forward", "fastlm.weighted_sum_backward"))  # fmt: skip
    torch.testing.assert_close(out, weighted_sum_ref(x, w) * 2, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(w.grad, 2 * x.detach().sum(0), rtol=1e-4, atol=1e-2)


def test_ops_pass_opcheck():
    x, w = torch.randn(5, 7), torch.randn(7)
    torch.library.opcheck(template._forward_op, (x, w))
    torch.library.opcheck(template._backward_op, (torch.randn(5), x, w))


def test_strided_weight_and_empty_rows():
    x = torch.randn(6, 8)
    w = torch.randn(8, 2)[:, 0]  # stride 2
    torch.testing.assert_close(weighted_sum(x, w), weighted_sum_ref(x, w))
    assert weighted_sum(torch.randn(3, 0), torch.randn(0)).tolist() == [0.0, 0.0, 0.0]
