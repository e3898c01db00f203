"""`fastlm.ops.fp8_linear`: the FP8 linear layer's forward and gradients against a float64 reference
of the same quantization (quantized here step by step, independently of the op), its distance to
the plain linear layer, all-zero operands, rows that are not a multiple of 16, bad inputs. On a CPU
``torch._scaled_mm`` is PyTorch's own kernel; with a GPU (sm89+) cuBLASLt's."""

import pytest
import torch

from fastlm.ops.fp8_linear import fp8_linear


def _quantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the layer's matmul reads it, in float64: scaled by FMAX / amax in fp32, clamped,
    rounded to ``dtype``, then divided by the same fp32 scale."""
    fmax = torch.finfo(dtype).max
    scale = torch.tensor(fmax, dtype=torch.float32) / t.detach().abs().amax().float().clamp(min=1e-12).cpu()
    rounded = (t.detach().float().cpu() * scale).clamp(-fmax, fmax).to(dtype)
    return rounded.double() * scale.reciprocal().double()


def _reference(x, weight, bias, grad_out):
    """(y, dx, dw, db) in float64 from the quantized operands."""
    rows, g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    xq, wq = _quantized(rows, torch.float8_e4m3fn), _quantized(weight, torch.float8_e4m3fn)
    gq = _quantized(g, torch.float8_e5m2)
    y = xq @ wq.T + (0 if bias is None else bias.detach().double().cpu())
    db = None if bias is None else g.detach().double().cpu().sum(0)
    return y.view(*x.shape[:-1], -1), (gq @ wq).view(x.shape), gq.T @ xq, db


def _close(actual, expected, dtype):
    """Within the output dtype's rounding (and fp32 summation) of the float64 value."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=tolerance, atol=tolerance * expected.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [(2, 8), (3, 7)], ids=["16-rows", "21-rows"])  # 21: padded for dw
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_same_quantization_in_float64(dtype, rows, with_bias, device):
    x = torch.randn(*rows, 32, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(48, 32, device=device) * 0.1).to(dtype).requires_grad_()
    bias = torch.randn(48, device=device, dtype=dtype, requires_grad=True) if with_bias else None
    out = fp8_linear(x, weight, bias)
    assert out.shape == (*rows, 48) and out.dtype == dtype
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, weight] + ([bias] if with_bias else []), grad_out)
    y, dx, dw, db = _reference(x, weight, bias, grad_out)
    _close(out, y, dtype)
    _close(grads[0], dx, dtype)
    _close(grads[1], dw, dtype)
    if with_bias:
        _close(grads[2], db, dtype)


def test_is_near_the_plain_linear_layer(device):
    """Rounding to e4m3 (3 mantissa bits) is off by about 2^-4 / sqrt(3) = 3.6% rms per element, to
    e5m2 (2 bits) by 7.2%: normwise, the output (two e4m3 operands) measures 3.7% here, dx and dw
    (an e5m2 and an e4m3 operand) 6.0%; the bounds leave a third more."""
    x = torch.randn(64, 256, device=device, requires_grad=True)
    weight = (torch.randn(128, 256, device=device) * 0.05).requires_grad_()
    out, exact = fp8_linear(x, weight), x @ weight.T
    assert 0 < (out - exact).norm() / exact.norm() < 0.05
    grad_out = torch.randn_like(out)
    grads, exact_grads = (
        torch.autograd.grad(out, [x, weight], grad_out),
        torch.autograd.grad(exact, [x, weight], grad_out),
    )
    for grad, exact_grad in zip(grads, exact_grads, strict=True):
        assert 0 < (grad - exact_grad).norm() / exact_grad.norm() < 0.08


def test_zero_operands_give_zeros_not_nan(device):
    x = torch.zeros(16, 32, device=device, requires_grad=True)
    weight = torch.randn(16, 32, device=device, requires_grad=True)
    out = fp8_linear(x, weight)
    dx, dw = torch.autograd.grad(out, [x, weight], torch.ones_like(out))
    assert not out.any() and not dw.any() and dx.isfinite().all() and dx.any()


def test_strided_and_empty_inputs(device):
    """A transposed input and a transposed output gradient (quantized row-major for the matmuls,
    which take no other layout) give the contiguous ones' results; no rows give an empty output."""
    x = torch.randn(32, 16, device=device).t().requires_grad_()  # (16, 32), column-major
    weight = torch.randn(48, 32, device=device, requires_grad=True)
    grad_out = torch.randn(48, 16, device=device).t()
    out = fp8_linear(x, weight)
    grads = torch.autograd.grad(out, [x, weight], grad_out)
    x_rows = x.detach().contiguous().requires_grad_()
    expected = fp8_linear(x_rows, weight)
    torch.testing.assert_close(out, expected)
    for grad, want in zip(grads, torch.autograd.grad(expected, [x_rows, weight], grad_out.contiguous()), strict=True):
        torch.testing.assert_close(grad, want)
    assert fp8_linear(torch.randn(0, 32, device=device), weight).shape == (0, 48)


@pytest.mark.parametrize(
    "x_shape,w_shape,message",
    [
        ((4, 30), (16, 30), "K and N multiples of 16"),
        ((4, 32), (20, 32), "K and N multiples of 16"),
        ((4, 32), (16, 48), "must share K"),
    ],
)
def test_bad_shapes_raise_one_clear_error(x_shape, w_shape, message):
    with pytest.raises(ValueError, match=message):
        fp8_linear(torch.randn(x_shape), torch.randn(w_shape))


def test_bad_dtypes_and_bias_raise_one_clear_error():
    with pytest.raises(TypeError, match="x must have dtype"):
        fp8_linear(torch.ones(4, 16, dtype=torch.int32), torch.randn(16, 16))
    with pytest.raises(ValueError, match="bias must be"):
        fp8_linear(torch.randn(4, 16), torch.randn(16, 16), torch.randn(8))
