"""How the kernels are launched: by Inductor's generated code, and by fastlm's direct launches."""

import torch

from fastlm.ops.launch import eager_kernel


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
