"""SwiGLU and GeGLU (tanh form and exact): output and both gradients against float64 in every
dtype, the halves of a fused projection and other strided inputs, explicit tiles, compile, errors."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from fastlm.ops import swiglu as op
from fastlm.ops.swiglu import GatedFunction, SwigluConfig, geglu, geglu_ref, swiglu, swiglu_config, swiglu_ref

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64, normwise_error, unit_roundoff
from .test_cross_entropy import poisoned_outputs  # noqa: F401 (a fixture)

# How far fastlm's normwise error may pass swiglu_ref's (both against float64), output and gradients
# alike. fp32: the same fp32 math, a few roundings in another order. fp16 / bf16: both round one
# fp32 value to the dtype, which a different last fp32 bit can move by one unit in the last place.
ALLOWANCE = {
    torch.float32: 1e-6,
    torch.bfloat16: unit_roundoff(torch.bfloat16) / 4,
    torch.float16: unit_roundoff(torch.float16) / 4,
}
DTYPES = list(ALLOWANCE)


# each gating: (public function, its reference, the kernels' ACTIVATION)
GATINGS = {
    "swiglu": (swiglu, swiglu_ref, "silu"),
    "geglu tanh": (geglu, geglu_ref, "gelu_tanh"),
    "geglu exact": (
        functools.partial(geglu, approximate="none"),
        functools.partial(geglu_ref, approximate="none"),
        "gelu",
    ),
}


def _pair(shape, dtype=torch.float32, device="cpu"):
    gate = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    return gate, torch.randn(shape, dtype=dtype, device=device, requires_grad=True)


def _halves(function):
    """``function`` on the two halves of a fused (..., 2D) projection output, as an MLP chunks it."""
    return lambda fused: function(*fused.chunk(2, dim=-1))


SHAPES = [
    (1, 1),  # one element
    (7,),  # one row, rank 1
    (3, 13),  # primes: partial column block
    (2, 5, 17),  # rank 3, primes
    (3, 8193),  # one column past the default block_d_max: a second, 1-wide column block
    (0, 5),  # no rows: no program may launch
    (4, 0),  # no columns
]


@pytest.mark.usefixtures("poisoned_outputs")  # outputs start as NaN: an unwritten element fails
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_with_gradients(shape, dtype, gating):
    function, reference, _ = GATINGS[gating]
    check_against_float64(function, reference, _pair(shape, dtype), ALLOWANCE[dtype])


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_halves_of_a_fused_projection(dtype, gating):
    # gate and up are views with row stride 2D into one (B, T, 2D) tensor; the upstream gradient is
    # itself strided (row stride 2D + 3), and the gradient reaches the fused tensor through chunk
    function, reference, _ = GATINGS[gating]
    fused = torch.randn(2, 5, 2 * 19, dtype=dtype, requires_grad=True)
    upstream = torch.randn(2, 5, 2 * 19 + 3, dtype=dtype)[..., :19]
    check_against_float64(_halves(function), _halves(reference), (fused,), ALLOWANCE[dtype], upstream=upstream)


def test_inputs_of_different_strides():
    # gate a transposed view (a strided last dim, copied into rows), up the first 9 columns of 12
    # (row stride 12, read in place); the upstream gradient of .sum() is expanded (stride 0)
    gate = torch.randn(9, 6).t().requires_grad_()  # (6, 9), column stride 6
    up = torch.randn(6, 12)[:, :9].requires_grad_()
    check_against_float64(swiglu, swiglu_ref, (gate, up), ALLOWANCE[torch.float32])
    got = torch.autograd.grad(swiglu(gate, up).sum(), (gate, up))
    want = torch.autograd.grad(swiglu_ref(gate, up).sum(), (gate, up))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_explicit_config_tiles_rows_and_columns(dtype, gating):
    # 8-wide, 2-row tiles over (5, 19): a grid of 3 x 3 programs, the last row and column tiles partial
    _, reference, activation = GATINGS[gating]
    config = dataclasses.replace(op.DEFAULT_CONFIG, tile_elements=16, block_d_max=8)
    assert config.blocks(19) == (2, 8)
    check_against_float64(
        lambda g, u: GatedFunction.apply(g, u, activation, config), reference, _pair((5, 19), dtype), ALLOWANCE[dtype]
    )


def test_config_for_every_architecture():
    # any architecture, known or not, and the interpreter (0) get a config, never an error
    for arch in (0, 75, 80, 90, 100, 120):
        assert isinstance(swiglu_config(arch, torch.bfloat16), SwigluConfig)
    assert swiglu_config(75, torch.float32) == op.DEFAULT_CONFIG
    # (BLOCK_R, BLOCK_D): narrow rows stack into one tile; wide ones are split, one row per tile
    config = SwigluConfig(tile_elements=4096, block_d_max=1024, num_warps=4)
    assert [config.blocks(d) for d in (0, 1, 5, 1024, 14336)] == [(4096, 1), (4096, 1), (512, 8), (4, 1024), (4, 1024)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        op.DEFAULT_CONFIG.num_warps = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="block_d_max must be a power of two, got 48"):
        SwigluConfig(tile_elements=4096, block_d_max=48, num_warps=4)


@pytest.mark.parametrize("gating", GATINGS)
def test_reference_path_without_interpreter(monkeypatch, gating):
    """CPU without TRITON_INTERPRET runs the PyTorch path, its backward written out by hand."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    function, reference, _ = GATINGS[gating]
    for dtype in DTYPES:
        check_against_float64(function, reference, _pair((4, 11), dtype), ALLOWANCE[dtype])


def test_large_magnitudes_give_no_nan():
    # the forward's exp(-g) overflows for g < -88 (silu is -0 there), the backward's exp(-|g|) never:
    # dgate is 0 far below zero and u far above it, where silu(g) = g
    gate = torch.tensor([-1000.0, -100.0, -89.0, 0.0, 89.0, 100.0, 1000.0], requires_grad=True)
    up = torch.full((7,), 2.0, requires_grad=True)
    out = swiglu(gate, up)
    dgate, dup = torch.autograd.grad(out, (gate, up), torch.ones(7))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 0.0, 178.0, 200.0, 2000.0]))
    torch.testing.assert_close(dgate, torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0]))
    torch.testing.assert_close(dup, out.detach() / 2)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_geglu_large_magnitudes_give_no_nan(approximate, path, monkeypatch):
    # the tanh form's cube overflows past |g| ~ 7e12 and its slope's dz/dg past ~2e19, where
    # s (1 - s) is 0: the gradient is 1 far above zero and 0 far below, never 0 * inf
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate = torch.tensor([-1e20, -1e13, -100.0, -12.0, 0.0, 12.0, 100.0, 1e13, 1e20], requires_grad=True)
    up = torch.full((9,), 2.0, requires_grad=True)
    out = geglu(gate, up, approximate)
    dgate, dup = torch.autograd.grad(out, (gate, up), torch.ones(9))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 24.0, 200.0, 2e13, 2e20]))
    torch.testing.assert_close(dgate, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]))
    torch.testing.assert_close(dup, out.detach() / 2)


def test_gelu_tanh_keeps_the_bits_of_its_negative_tail():
    # for g in [-9, -3], PyTorch's 0.5 g (1 + tanh(k)) cancels in 1 + tanh(k) (about 5e-5 normwise
    # in fp32, output and gradient); the kernels' g sigmoid(2k) does not (about 3e-7)
    gate = torch.linspace(-9.0, -3.0, 1001, requires_grad=True)
    up = torch.ones(1001)
    exact = gate.detach().double().requires_grad_()
    truth = F.gelu(exact, approximate="tanh")
    (truth_grad,) = torch.autograd.grad(truth.sum(), exact)

    def errors(function):  # (output's, gradient's) normwise errors
        out = function(gate, up)
        (grad,) = torch.autograd.grad(out.sum(), gate)
        return normwise_error(out, truth), normwise_error(grad, truth_grad)

    ours, torchs = errors(geglu), errors(lambda g, u: F.gelu(g, approximate="tanh") * u)
    assert all(mine < theirs / 20 for mine, theirs in zip(ours, torchs, strict=True)), (ours, torchs)
    assert max(ours) < 8 * unit_roundoff(torch.float32)


def test_gate_gradient_does_not_cancel_where_sigmoid_is_near_one():
    # for g in [4, 16], 1 - sigmoid(g) computed as a difference loses up to log2(1 / (1 - s)) bits
    # (PyTorch's silu backward in fp32: about 3e-7 normwise); the kernel's sigmoid(-g) keeps them
    gate = torch.linspace(4.0, 16.0, 1001, requires_grad=True)
    up = torch.ones(1001)
    (dgate,) = torch.autograd.grad(swiglu(gate, up), gate, torch.ones(1001))
    exact = gate.detach().double().requires_grad_()
    (truth,) = torch.autograd.grad(swiglu_ref(exact, up.double()), exact, torch.ones(1001, dtype=torch.float64))
    assert normwise_error(dgate, truth) < 2 * unit_roundoff(torch.float32)


@pytest.mark.parametrize("gating", GATINGS)
def test_double_backward_is_an_error_not_a_wrong_gradient(gating):
    gate, up = _pair((3, 4))
    (dgate,) = torch.autograd.grad(GATINGS[gating][0](gate, up).square().sum(), gate, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dgate.sum().backward()


@pytest.mark.parametrize("gating", GATINGS)
def test_compiles_without_graph_breaks(gating):
    function, reference, _ = GATINGS[gating]
    fused = torch.randn(2, 3, 2 * 8, requires_grad=True)

    def loss(function, fused):
        return function(*fused.chunk(2, dim=-1)).square().sum()

    compiled = torch.compile(lambda fused: loss(function, fused), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        torch.autograd.grad(compiled(fused), fused), torch.autograd.grad(loss(reference, fused), fused)
    )


def test_ops_pass_opcheck():
    gate, up = torch.randn(5, 2 * 7).chunk(2, dim=-1)  # strided rows: the kernel's and PyTorch's outputs agree
    torch.library.opcheck(op._forward_op, (gate, up))
    torch.library.opcheck(op._backward_op, (torch.randn(5, 7), gate, up))
    for approximate in ("tanh", "none"):
        torch.library.opcheck(op._geglu_forward_op, (gate, up, approximate))
        torch.library.opcheck(op._geglu_backward_op, (torch.randn(5, 7), gate, up, approximate))


BAD = [
    (lambda g, u: ([1.0], u), TypeError, "gate must be a torch.Tensor"),
    (lambda g, u: (g, None), TypeError, "up must be a torch.Tensor"),
    (lambda g, u: (g[0, 0], u[0, 0]), ValueError, "gate must have at least one dimension"),
    (lambda g, u: (g, u[:, :3]), ValueError, "up must have gate's shape (4, 6), got (4, 3)"),
    (lambda g, u: (g, u.t()), ValueError, "up must have gate's shape (4, 6), got (6, 4)"),
    (lambda g, u: (g.double(), u.double()), TypeError, "gate must have dtype in (float32, float16, bfloat16)"),
    (lambda g, u: (g.long(), u.long()), TypeError, "gate must have dtype in"),
    (lambda g, u: (g, u.bfloat16()), TypeError, "up must have gate's dtype torch.float32, got torch.bfloat16"),
    (lambda g, u: (g, u.to("meta")), ValueError, "expected all tensors on one device, got gate on cpu, up on meta"),
]


@pytest.mark.parametrize("gating", ["swiglu", "geglu tanh"])
@pytest.mark.parametrize("bend, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_inputs_are_clear_errors(bend, error, message, gating):
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        GATINGS[gating][0](*bend(gate, up))


def test_geglu_approximate_is_tanh_or_none():
    gate = torch.randn(4, 6)
    for approximate in ("erf", None, "Tanh"):
        with pytest.raises(ValueError, match=f"approximate must be 'tanh' or 'none', got {approximate!r}"):
            geglu(gate, gate, approximate)


@pytest.mark.gpu
@pytest.mark.parametrize("gating", GATINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_reference_at_an_mlp_shape(dtype, gating):
    # 1024 tokens of Llama-3.1-8B's MLP (D = 14336): two column tiles per row, the second partial
    function, reference, _ = GATINGS[gating]
    fused = torch.randn(1024, 2 * 14336, dtype=dtype, device="cuda", requires_grad=True)
    check_against_float64(_halves(function), _halves(reference), (fused,), ALLOWANCE[dtype])


@pytest.mark.gpu
def test_gpu_offsets_past_2_to_the_31():
    # R * D just past 2^31 elements: the last rows' offsets overflow int32
    rows, width = 2**31 // 4096 + 3, 4096
    gate, up = _pair((rows, width), torch.bfloat16, "cuda")
    out = swiglu(gate, up)
    got = (out, *torch.autograd.grad(out, (gate, up), torch.ones_like(out)))
    tail = [t[-4:].detach().requires_grad_() for t in (gate, up)]
    want = swiglu_ref(*tail)
    for g, e in zip(got, (want, *torch.autograd.grad(want, tail, torch.ones_like(want))), strict=True):
        torch.testing.assert_close(g[-4:], e)


@pytest.mark.gpu
@pytest.mark.parametrize("gating, op_name", [("swiglu", "swiglu"), ("geglu tanh", "geglu")])
def test_gpu_inductor_launches_the_kernels_from_its_code(gating, op_name):
    function, reference, _ = GATINGS[gating]
    fused = torch.randn(256, 2 * 512, device="cuda", requires_grad=True)

    def doubled(fused):
        return function(*fused.chunk(2, dim=-1)) * 2

    compiled_code_launches(
        doubled,
        (fused,),
        kernels=("_glu_forward_kernel", "_glu_backward_kernel"),
        ops=(f"fastlm.{op_name}_forward", f"fastlm.{op_name}_backward"),
    )
    check_against_float64(
        torch.compile(doubled, fullgraph=True),
        lambda fused: _halves(reference)(fused) * 2,
        (fused,),
        ALLOWANCE[torch.float32],
    )


@pytest.mark.gpu
@pytest.mark.parametrize("gating", GATINGS)
def test_gpu_direct_launch_matches_tritons_dispatcher(monkeypatch, gating):
    kernels = (op._glu_forward_kernel, op._glu_backward_kernel)
    dy = torch.randn(37, 60, device="cuda")
    function = GATINGS[gating][0]

    def forward_and_grads(gate, up):
        out = function(gate, up)
        return (out, *torch.autograd.grad(out, (gate, up), dy))

    forward_and_grads(*_pair((37, 60), device="cuda"))  # the aligned binaries first: they must not serve below
    # gate 4 bytes past a 16-byte boundary with row stride 61, up with row stride 63
    gate = torch.randn(37 * 61 + 1, device="cuda")[1:].view(37, 61)[:, :60].requires_grad_()
    up = torch.randn(37, 63, device="cuda")[:, :60].requires_grad_()
    assert_direct_launch_matches_dispatcher(lambda: forward_and_grads(gate, up), kernels, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("gating", GATINGS)
def test_gpu_compiles_with_dynamic_shapes(gating):
    # sizes are SymInts inside the traced launchers: nothing may hash them (the config cache)
    function, reference, _ = GATINGS[gating]
    compiled = torch.compile(lambda g, u: function(g, u).square().sum(), fullgraph=True, dynamic=True)
    for rows, width in ((64, 96), (100, 5000)):
        gate, up = _pair((rows, width), device="cuda")
        got = torch.autograd.grad(compiled(gate, up), (gate, up))
        want = torch.autograd.grad(reference(gate, up).square().sum(), (gate, up))
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e)
