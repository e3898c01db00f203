"""The gradient norm clipping scales by: PyTorch's for one dtype, fp32 for bf16, one order."""

import torch

from fastlm.optim.clip import grad_norm


def test_one_dtype_is_pytorchs_norm():
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2) * 100]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    assert torch.equal(grad_norm(grads), torch.nn.utils.clip_grad_norm_(params, 1e9))


def test_bf16_in_fp32_and_values_held_in_another_dtype():
    grads = [torch.randn(100).bfloat16(), torch.randn(30), torch.randn(50).bfloat16()]
    expected = torch.stack([g.float().norm() for g in grads]).norm()
    norm = grad_norm(grads)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected)
    # fp32 gradients measured through bf16 copies of them (their values exactly): the same norm
    fp32 = [torch.randn(10).bfloat16().float() for _ in range(3)]
    assert torch.equal(grad_norm([g.bfloat16() for g in fp32], [torch.float32] * 3), grad_norm(fp32))


def test_summed_grouped_by_the_gradients_dtypes():
    """Per-tensor norms are combined dtype group by dtype group, in order of first appearance: the
    same tensors listed in another order within their groups give the same bits."""
    a, b, c = torch.randn(9) * 1e3, torch.randn(4).bfloat16(), torch.randn(6) * 1e-3
    assert torch.equal(grad_norm([a, b, c]), grad_norm([a, c, b], [a.dtype, c.dtype, b.dtype]))


def test_fp64_and_nothing():
    assert grad_norm([torch.ones(4, dtype=torch.float64)]).dtype == torch.float64
    assert grad_norm([]) == 0
