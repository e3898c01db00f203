"""The comparison every op test makes: output and input gradients against the fp64 reference."""

import torch


def check_against_reference(fn, ref, inputs, tolerance, grad_atol_factor=10):
    """``fn(*inputs)`` and ``ref`` on fp64 copies of ``inputs`` (None entries pass through): the
    output (same shape and dtype as the reference's input) and the gradient of every input that
    requires grad, for one random upstream gradient. Returns the kernel's output."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    out = fn(*inputs)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    copies = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    expected = ref(*copies)
    expected_grads = torch.autograd.grad(expected, [c for c in copies if c is not None and c.requires_grad],
                                         dy.double())  # fmt: skip
    rtol, atol = tolerance
    assert out.dtype == inputs[0].dtype and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * grad_atol_factor)
    return out


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (2-norms over all elements; 0 for two empty
    or two zero tensors): one number for a whole output, relative to its size."""
    expected = expected.detach().double()
    difference = (actual.detach().double() - expected).norm()
    return float(difference / expected.norm()) if difference else 0.0
