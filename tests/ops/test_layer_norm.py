"""LayerNorm / RMSNorm kernels against fp64 references: outputs, every gradient, edge cases."""

import pytest
import torch

from fastlm.ops import layer_norm as norm_module
from fastlm.ops.layer_norm import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref

from .reference import compiled_code_launches

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2)}


def _run(kind, x, weight, bias, dy):
    """Output and gradients (x, weight, bias: None where not requiring grad) of the kernel or reference."""
    leaves = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
    if kind == "rms":
        fn, ref = rms_norm, rms_norm_ref
        args = (x, weight)
    else:
        fn, ref = layer_norm, layer_norm_ref
        args = (x, weight, bias)
    out = fn(*args)
    grads = torch.autograd.grad(out, leaves, dy)
    copies = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in args]
    expected = ref(*copies)
    expected_grads = torch.autograd.grad(expected, [c for c in copies if c is not None and c.requires_grad],
                                         dy.double())  # fmt: skip
    return out, grads, expected, expected_grads


def _check(kind, x, weight=None, bias=None):
    dy = torch.randn_like(x)
    out, grads, expected, expected_grads = _run(kind, x, weight, bias, dy)
    rtol, atol = TOLERANCES[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected.double(), rtol=rtol, atol=atol)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("width", [1, 37, 128, 1000])
def test_matches_reference_with_all_gradients(kind, width):
    x = torch.randn(3, 5, width, requires_grad=True)  # 15 rows: a partial last tile of rows
    weight = torch.randn(width, requires_grad=True)
    bias = torch.randn(width, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias)


@pytest.mark.parametrize("rows", [7, 41])  # backward chunks of 2 and 4 rows (4 programs on CPU), last one partial
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_wide_rows_take_the_looped_path(kind, rows, monkeypatch):
    monkeypatch.setattr(norm_module, "FORWARD_BLOCK_MAX", 64)  # 300 columns: 5 chunks of 64, last one partial
    monkeypatch.setattr(norm_module, "BACKWARD_BLOCK_MAX", 64)
    monkeypatch.setattr(norm_module, "LOOPED_BACKWARD_ROWS", 4)
    assert norm_module.backward_config(300, rows, torch.device("cpu"), 4, kind == "rms").block_m == (
        2 if rows == 7 else 4
    )
    x = torch.randn(rows, 300, requires_grad=True)
    weight = torch.randn(300, requires_grad=True)
    bias = torch.randn(300, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias)


def test_looped_backward_chunks_hold_no_more_rows_than_there_are(monkeypatch):
    monkeypatch.setattr(norm_module, "BACKWARD_BLOCK_MAX", 64)
    monkeypatch.setattr(norm_module, "LOOPED_BACKWARD_ROWS", 4)
    for rows, chunk_rows in ((1, 1), (2, 1), (3, 1), (16, 4), (1000, 4)):  # 4 programs on CPU
        assert norm_module.backward_config(300, rows, torch.device("cpu"), 4, False).block_m == chunk_rows


def test_only_16_bit_rms_norm_keeps_16384_wide_rows_in_registers_in_the_backward():
    def single_pass(element_size, rms):
        return norm_module.backward_config(16384, 64, torch.device("cpu"), element_size, rms).single_pass

    assert single_pass(2, rms=True)
    assert not single_pass(4, rms=True) and not single_pass(2, rms=False) and not single_pass(4, rms=False)
    assert not norm_module.backward_config(32768, 64, torch.device("cpu"), 2, True).single_pass


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_low_precision(kind, dtype):
    x = (torch.randn(4, 96) * 3 + 1).to(dtype).requires_grad_()
    weight = torch.randn(96, dtype=dtype, requires_grad=True)
    bias = torch.randn(96, dtype=dtype, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias)


@pytest.mark.parametrize("shape", [(33,), (2, 3, 4, 33)])
def test_any_rank(shape):
    _check("layer", torch.randn(shape, requires_grad=True), torch.randn(shape[-1], requires_grad=True))


def test_non_contiguous_inputs():
    base = torch.randn(6, 40, 10)
    x = base.transpose(1, 2)[:, :, 5:35].detach().requires_grad_()  # last-dim stride 10, not 1
    _check("rms", x, torch.randn(30, requires_grad=True))
    rows = torch.randn(8, 64)[::2].detach().requires_grad_()  # row stride 128
    _check("layer", rows, torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True))


def test_frozen_or_missing_weights():
    x = torch.randn(4, 50, requires_grad=True)
    frozen = torch.randn(50)
    _check("layer", x, frozen, torch.randn(50, requires_grad=True))
    _check("rms", x, frozen)
    _check("layer", x)  # no affine parameters
    _check("layer", x, None, torch.randn(50, requires_grad=True))


def test_layer_norm_output_has_zero_mean_and_unit_variance():
    x = torch.randn(16, 256) * 7 + 3
    y = layer_norm(x, eps=0.0).double()
    torch.testing.assert_close(y.mean(-1), torch.zeros(16, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(16, dtype=torch.float64), atol=1e-4, rtol=0)
    z = rms_norm(x, eps=0.0).double()
    torch.testing.assert_close(z.square().mean(-1), torch.ones(16, dtype=torch.float64), atol=1e-4, rtol=0)


def test_weight_gradients_are_deterministic():
    x = torch.randn(64, 200, requires_grad=True)
    weight, bias = torch.randn(200, requires_grad=True), torch.randn(200, requires_grad=True)
    dy = torch.randn(64, 200)
    first = torch.autograd.grad(layer_norm(x, weight, bias), (weight, bias), dy)
    second = torch.autograd.grad(layer_norm(x, weight, bias), (weight, bias), dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_empty_input():
    x = torch.randn(0, 16, requires_grad=True)
    y = rms_norm(x, torch.ones(16, requires_grad=True))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)


def test_compiles_without_graph_breaks():
    x, weight, bias = torch.randn(4, 48, requires_grad=True), torch.randn(48, requires_grad=True), torch.randn(48)
    compiled = torch.compile(lambda x: layer_norm(x, weight, bias), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, layer_norm_ref(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert x.grad is not None and weight.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_inductor_launches_the_kernels_from_its_code(dtype):
    # The ops are triton_ops: Inductor's generated code launches the Triton kernels itself, the
    # weight-gradient sum included (no opaque op call per launch).
    x = torch.randn(256, 1600, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(1600, device="cuda", dtype=dtype, requires_grad=True)
    out = compiled_code_launches(lambda x, weight: rms_norm(x * 2, weight), (x, weight),
                                 kernels=("_norm_forward_kernel", "_norm_backward_kernel", "_sum_partials_kernel"),
                                 ops=("fastlm.norm_forward", "fastlm.norm_backward"))  # fmt: skip
    dx, dw = x.grad, weight.grad
    expected = rms_norm_ref(x * 2, weight)
    want_dx, want_dw = torch.autograd.grad(expected.float().sum(), (x, weight))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(dx.float(), want_dx.float(), rtol=tol, atol=tol * want_dx.abs().max().item())
    torch.testing.assert_close(dw.float(), want_dw.float(), rtol=tol, atol=tol * want_dw.abs().max().item())


def test_ops_pass_opcheck():
    x, weight = torch.randn(8, 40), torch.randn(40)
    torch.library.opcheck(norm_module._forward_op, (x, weight, None, 1e-5, True, torch.bfloat16))
    torch.library.opcheck(norm_module._forward_op, (x, weight, torch.randn(40), 1e-5, False, torch.float32))
    mean, rstd = x.mean(-1), torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
    torch.library.opcheck(norm_module._backward_op, (torch.randn(8, 40), x, weight, mean, rstd, False, True, True))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.randn(()),), ValueError, "at least one dimension"),
        ((torch.randn(3, 4), torch.randn(5)), ValueError, r"weight must have shape \(4,\)"),
        ((torch.randn(3, 4), None, torch.randn(3)), ValueError, r"bias must have shape \(4,\)"),
        ((torch.randn(3, 4).double(),), TypeError, "x must have dtype"),
        ((torch.randn(3, 4), torch.randn(4).int()), TypeError, "weight must have dtype"),
    ],
)
def test_bad_inputs_raise_one_clear_error(args, error, message):
    with pytest.raises(error, match=message):
        layer_norm(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 16384, 65536])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_bf16_and_wide_rows(kind, width):
    _check_gpu_bf16(kind, 64, width)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_wide_rows_in_chunks_of_several_rows(kind):
    # enough rows that every backward program gets chunks of LOOPED_BACKWARD_ROWS rows; a partial last one
    width = 32768  # looped for both norms in bf16
    chunks = norm_module.backward_config(width, 1 << 20, torch.device("cuda"), 2, kind == "rms")
    programs = norm_module._backward_programs(1 << 30, torch.device("cuda"), chunks, element_size=2)
    rows = norm_module.LOOPED_BACKWARD_ROWS * programs + 3
    config = norm_module.backward_config(width, rows, torch.device("cuda"), 2, kind == "rms")
    assert not config.single_pass and config.block_m == norm_module.LOOPED_BACKWARD_ROWS
    _check_gpu_bf16(kind, rows, width)


def _check_gpu_bf16(kind, rows, width):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True) if kind == "layer" else None
    dy = torch.randn_like(x)
    out, grads, expected, expected_grads = _run(kind, x, weight, bias, dy)
    torch.testing.assert_close(out.double(), expected.double(), rtol=1.6e-2, atol=1.6e-2)
    for got, want in zip(grads, expected_grads, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * max(1.0, scale))


def test_modules_match_torch():
    import fastlm.nn

    x = torch.randn(3, 24)
    torch.testing.assert_close(fastlm.nn.LayerNorm(24)(x), torch.nn.LayerNorm(24)(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fastlm.nn.RMSNorm(24, eps=1e-6)(x), torch.nn.RMSNorm(24, eps=1e-6)(x),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert fastlm.nn.LayerNorm(24, bias=False).bias is None


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_out_dtype_rounds_the_fp32_result_once(kind):
    x = torch.randn(6, 40, requires_grad=True)
    weight = torch.randn(40, requires_grad=True)
    norm, ref = (layer_norm, layer_norm_ref) if kind == "layer" else (rms_norm, rms_norm_ref)
    out = norm(x, weight, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # at most one bf16 ulp apart (fp32 results that differ in the last bits may round either way)
    torch.testing.assert_close(out, ref(x, weight).to(torch.bfloat16), rtol=2**-7, atol=1e-2)
    dy = torch.randn(6, 40).to(torch.bfloat16)
    got = torch.autograd.grad(out, (x, weight), dy)
    want = torch.autograd.grad(ref(x, weight), (x, weight), dy.float())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        norm(x, weight, out_dtype=torch.int32)
