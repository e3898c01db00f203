"""The comparison every op test makes: output and input gradients against the fp64 reference."""

import torch

from fastlm.ops.launch import eager_kernel


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


def compiled_code_launches(fn, inputs, kernels, ops):
    """Compile ``fn`` with Inductor, run it and its backward on ``inputs`` (the gradient of the
    sum of the output), and check that the generated code launches every Triton kernel named in
    ``kernels`` itself and never calls back into the torch.library ``ops``. Returns the output."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)

    def step():
        out = compiled(*inputs)
        out.float().sum().backward()
        return out

    out, code = run_and_get_code(step)  # the forward and the backward graph's code
    joined = "\n".join(code)
    for kernel in kernels:
        assert kernel in joined, f"Inductor's code does not launch {kernel}"
    for op in ops:
        assert op not in joined, f"Inductor's code calls the op {op} instead of tracing through it"
    return out


def assert_direct_launch_matches_dispatcher(run, kernels, monkeypatch):
    """``run()`` (a tuple of tensors) gives the same bits from fastlm's direct launches as from
    Triton's dispatcher: the first call goes through Triton, which compiles this specialization;
    the second launches the cached binaries (every kernel in ``kernels`` must have one); the third
    runs with every kernel back on Triton's dispatcher."""
    run()
    direct = run()
    assert all(any(eager_kernel(kernel)._binaries.values()) for kernel in kernels), "a kernel never launched directly"
    for kernel in kernels:
        monkeypatch.setattr(eager_kernel(kernel), "direct", False)
    for got, want in zip(direct, run(), strict=True):
        assert torch.equal(got, want)


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (2-norms over all elements; 0 for two empty
    or two zero tensors): one number for a whole output, relative to its size."""
    expected = expected.detach().double()
    difference = (actual.detach().double() - expected).norm()
    return float(difference / expected.norm()) if difference else 0.0
