"""The float64 check every op test makes: fastlm at least as accurate as PyTorch.

fastlm's result and PyTorch's (the same computation in plain PyTorch: the op's `*_ref` or
PyTorch's own function, on the same inputs) are both compared with that computation on float64
copies of the inputs, which it must carry out in float64: the output, and the gradient of every
input that requires grad for one upstream gradient. The error is normwise (`normwise_error`), and
fastlm's may pass PyTorch's by no more than the allowance a test states in its tolerance table:
about 1e-6 in fp32, where both accumulate rounding errors in different orders; a fraction of the
unit roundoff in bf16 / fp16, where both round to the dtype, at different points. Measured
against PyTorch's own error, the bound holds at every magnitude and shape: a case PyTorch computes
badly does not fail fastlm, and easy cases are not judged by a tolerance loose enough for the hard.
"""

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative error of one rounding to ``dtype`` (half the gap above 1.0): 2^-24 in
    fp32, 2^-8 in bf16, 2^-11 in fp16."""
    return torch.finfo(dtype).eps / 2


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (2-norms over all elements): one number for a
    whole output, relative to its size. An all-zero ``expected`` (a gradient that vanishes exactly)
    gives the absolute ||actual - expected||, and two empty tensors 0."""
    expected = expected.detach().double()
    difference = (actual.detach().double() - expected).norm()
    size = expected.norm()
    return float(difference / size) if size else float(difference)


def _largest_errors(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where ``actual`` is farthest from ``expected``: absolutely, and relative to |expected|
    (a NaN counts as the largest)."""
    if actual.numel() == 0:
        return "empty"
    actual, expected = actual.detach().double(), expected.detach().double()
    absolute = (actual - expected).abs()
    relative = torch.where(expected != 0, absolute / expected.abs(), 0.0)
    at, rel_at = (tuple(int(i) for i in torch.unravel_index(e.argmax(), e.shape)) for e in (absolute, relative))
    return (
        f"max abs error {absolute[at]:.3g} at {at} ({actual[at]:.8g} for {expected[at]:.8g}), "
        f"max rel error {relative[rel_at]:.3g} at {rel_at}"
    )


def assert_as_accurate_as_torch(ours, theirs, truth, allowance: float, what: str = "output") -> None:
    """fastlm's result ``ours`` is no farther from the float64 ``truth`` than PyTorch's ``theirs``
    (same inputs) plus ``allowance``, in normwise error. All three have one shape, and ``ours`` a
    dtype at least as precise as ``theirs`` (fastlm returns a 16-bit input's losses in fp32)."""
    shapes = f"fastlm {ours.dtype} {tuple(ours.shape)}, torch {theirs.dtype} {tuple(theirs.shape)}"
    assert ours.shape == theirs.shape == truth.shape, f"{what}: {shapes}, float64 {tuple(truth.shape)}"
    assert torch.finfo(ours.dtype).eps <= torch.finfo(theirs.dtype).eps, f"{what}: {shapes}"
    assert truth.dtype == torch.float64 and torch.isfinite(truth).all(), f"{what}: the truth is not finite float64"
    mine, torchs = normwise_error(ours, truth), normwise_error(theirs, truth)
    assert mine <= torchs + allowance, (
        f"{what} ({ours.dtype}, shape {tuple(ours.shape)}): fastlm's normwise error {mine:.3g} > torch's "
        f"{torchs:.3g} + {allowance:.3g}\n  fastlm: {_largest_errors(ours, truth)}\n"
        f"  torch:  {_largest_errors(theirs, truth)}"
    )


def gradients(out, inputs, upstream) -> tuple[torch.Tensor, ...]:
    """The gradient of (out * upstream).sum() for each of ``inputs`` that requires grad, in order
    (None entries are skipped)."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(out, leaves, upstream.to(out.dtype)) if leaves else ()


def _output_and_gradients(function, inputs, upstream) -> list[torch.Tensor]:
    """[function(*inputs), *its `gradients`]."""
    out = function(*inputs)
    return [out, *gradients(out, inputs, upstream)]


def check_results_against_float64(
    ours, torch_fn, inputs, upstream, allowance: float, grad_allowance: float | None = None
) -> None:
    """fastlm's results ``ours`` ([output, gradient of each input that requires grad] for
    ``upstream``) against the same from ``torch_fn`` on ``inputs`` (floating tensors or None, which
    passes through) and on float64 copies of them, by `assert_as_accurate_as_torch`: the output
    with ``allowance``, the gradients with ``grad_allowance`` (default: the same)."""
    theirs = _output_and_gradients(torch_fn, inputs, upstream)
    copies = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    truth = _output_and_gradients(torch_fn, copies, upstream)
    names = [f"gradient of input {i}" for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    assert len(ours) == len(theirs), f"fastlm gives {len(ours)} results, torch {len(theirs)}"
    for index, what in enumerate(["output", *names]):
        limit = allowance if index == 0 or grad_allowance is None else grad_allowance
        assert_as_accurate_as_torch(ours[index], theirs[index], truth[index], limit, what)


def check_against_float64(
    fastlm_fn,
    torch_fn,
    inputs,
    allowance: float,
    grad_allowance: float | None = None,
    upstream: torch.Tensor | None = None,
) -> torch.Tensor:
    """`check_results_against_float64` for ``fastlm_fn(*inputs)`` and its gradients. The upstream
    gradient, random unless given, is rounded to the narrowest dtype of the inputs and the output,
    so that fastlm, torch and the float64 truth receive the same values. Returns fastlm's output."""
    out = fastlm_fn(*inputs)
    narrowest = max((t.dtype for t in (out, *inputs) if t is not None), key=lambda dtype: torch.finfo(dtype).eps)
    upstream = (torch.randn_like(out) if upstream is None else upstream).to(narrowest)
    check_results_against_float64(
        [out, *gradients(out, inputs, upstream)], torch_fn, inputs, upstream, allowance, grad_allowance
    )
    return out
