"""LayerNorm / RMSNorm kernels against fp64 references: outputs, every gradient, edge cases."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from fastlm.ops import layer_norm as norm_module
from fastlm.ops.layer_norm import (
    NormConfig,
    backward_tiles,
    layer_norm,
    layer_norm_ref,
    norm_config,
    rms_norm,
    rms_norm_ref,
)

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64, unit_roundoff

# How far fastlm's normwise error may pass that of F.layer_norm / F.rms_norm (float64: the truth),
# outputs and gradients alike: in fp32, sums taken in other orders (the rows' statistics; dw and db
# over the rows); in 16-bit, an eighth of the unit roundoff, as both accumulate in fp32 and round
# each result to the dtype once, at different points.
ALLOWANCE = {
    torch.float32: 1e-6,
    torch.float16: unit_roundoff(torch.float16) / 8,
    torch.bfloat16: unit_roundoff(torch.bfloat16) / 8,
}


DEFAULT = norm_config(0)  # what the interpreter runs (0: no GPU architecture)


def _norm(kind, config=None):
    """The public function, or, with a launch config, the same call through autograd on that config."""
    rms = kind == "rms"
    if config is None:
        return rms_norm if rms else layer_norm
    if rms:
        return lambda x, w: norm_module._apply(x, w, None, 1e-5, True, None, config)
    return lambda x, w, b: norm_module._apply(x, w, b, 1e-5, False, None, config)


def _torch_norm(kind):
    """PyTorch's own op, with fastlm's semantics (normalized over the last dim, eps 1e-5): the
    float64 truth and PyTorch's error in the input dtype, which the shared checker compares."""
    if kind == "rms":
        return lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-5)
    return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def _check(kind, x, weight=None, bias=None, config=None):
    """Output and every gradient (of x, weight and bias where they require grad) against PyTorch's
    op, by `check_against_float64`."""
    args = (x, weight) if kind == "rms" else (x, weight, bias)
    out = check_against_float64(_norm(kind, config), _torch_norm(kind), args, ALLOWANCE[x.dtype])
    assert out.dtype == x.dtype


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("width", [1, 37, 128, 1000])
def test_matches_reference_with_all_gradients(kind, width):
    x = torch.randn(3, 5, width, requires_grad=True)  # 15 rows: a partial last tile of rows
    weight = torch.randn(width, requires_grad=True)
    bias = torch.randn(width, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias)


# Rows wider than 64 loop (300 columns: 5 chunks of 64, the last one partial); backward chunks of up
# to 4 rows; dw / db over column blocks of 64 (5 blocks, the last one partial), summed 4 partial rows
# at a time (7 and 16 row groups: a partial last step).
LOOPED = dataclasses.replace(
    DEFAULT,
    forward_block_max=64,
    backward_block_max=64,
    looped_backward_rows=4,
    param_grad_block_d=64,
    fused_sum_group=4,
)


@pytest.mark.parametrize("rows", [7, 41])  # backward chunks of 2 and 4 rows (4 programs on CPU), last one partial
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_wide_rows_take_the_looped_path(kind, rows):
    tiles, programs = backward_tiles(LOOPED, 300, rows, 4, kind == "rms", 0)
    assert not tiles.single_pass and (tiles.block_m, programs) == ((2, 4) if rows == 7 else (4, 4))
    x = torch.randn(rows, 300, requires_grad=True)
    weight = torch.randn(300, requires_grad=True)
    bias = torch.randn(300, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias, LOOPED)


def one_plus_weight_rms_norm(x, weight):
    """Gemma's RMSNorm as transformers writes it: fp32 (float64 stays), times 1 + weight, cast last."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return (F.rms_norm(x.to(compute), x.shape[-1:], eps=1e-6) * (1 + weight.to(compute))).to(x.dtype)


@pytest.mark.parametrize("config", [None, LOOPED], ids=["registers", "looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_offset_is_gemmas_one_plus_weight(dtype, config):
    # weights near 0 (Gemma's init): the offset, not the weight, sets the scale; 300 columns loop
    # under LOOPED, in 64-wide chunks (the last partial), where the offset is added on each chunk
    x = torch.randn(7, 300, dtype=dtype, requires_grad=True)
    weight = (0.1 * torch.randn(300)).to(dtype).requires_grad_()
    if config is None:
        function = functools.partial(rms_norm, eps=1e-6, weight_offset=1.0)
    else:
        function = functools.partial(norm_module._apply, bias=None, eps=1e-6, rms=True, out_dtype=None, config=config,
                                     weight_offset=1.0)  # fmt: skip
    out = check_against_float64(function, one_plus_weight_rms_norm, (x, weight), ALLOWANCE[dtype])
    assert out.dtype == dtype


def test_weight_offset_leaves_the_weights_gradient_as_it_is():
    # d/dw of x_hat * (w + 1) is d/dw of x_hat * w: both gradients are sum_rows dy * x_hat
    x, dy = torch.randn(5, 37), torch.randn(5, 37)
    weight = torch.randn(37, requires_grad=True)
    (plain,) = torch.autograd.grad(rms_norm(x, weight), weight, dy)
    (offset,) = torch.autograd.grad(rms_norm(x, weight, weight_offset=1.0), weight, dy)
    torch.testing.assert_close(offset, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, weight, weight_offset=1.0), rms_norm(x, weight + 1.0))


def test_weight_offset_on_the_reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight = torch.randn(4, 11, requires_grad=True), torch.randn(11, requires_grad=True)
    check_against_float64(
        functools.partial(rms_norm, eps=1e-6, weight_offset=1.0), one_plus_weight_rms_norm, (x, weight), 1e-6
    )


def test_looped_backward_chunks_hold_no_more_rows_than_there_are():
    for rows, chunk_rows in ((1, 1), (2, 1), (3, 1), (16, 4), (1000, 4)):  # 4 programs on CPU
        assert backward_tiles(LOOPED, 300, rows, 4, False, 0)[0].block_m == chunk_rows


def test_only_16_bit_rms_norm_keeps_16384_wide_rows_in_registers_in_the_backward():
    def single_pass(element_size, rms, width=16384):
        return backward_tiles(DEFAULT, width, 64, element_size, rms, 0)[0].single_pass

    assert single_pass(2, rms=True)
    assert not single_pass(4, rms=True) and not single_pass(2, rms=False) and not single_pass(4, rms=False)
    assert not single_pass(2, rms=True, width=32768)


# The dw / db sums of the single-pass backward at their edges: 2-row tiles of 37 columns, summed 16
# columns at a time (a partial last block); 5 rows give 3 programs, 41 rows give 4 programs of
# several tiles each. Summed in the launch, in groups of 2 (a partial last group at 3 programs; 2
# full ones at 4) and of 1 (every program is its group's last); or by the separate kernel, 2
# partial rows per step (a partial last step at 3).
SUMS = {
    "fused in groups of 2": dataclasses.replace(DEFAULT, fused_sum_group=2, fused_sum_block_d=16),
    "fused in groups of 1": dataclasses.replace(DEFAULT, fused_sum_group=1, fused_sum_block_d=16),
    "separate kernel": dataclasses.replace(DEFAULT, fused_sum_max_d=0, sum_block_p=2, sum_block_d=16),
}


@pytest.mark.parametrize("sums", SUMS)
@pytest.mark.parametrize("rows", [5, 41])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_single_pass_weight_gradients_are_summed_in_a_fixed_order(kind, rows, sums):
    config = dataclasses.replace(SUMS[sums], backward_tile=128)
    tiles, programs = backward_tiles(config, 37, rows, 4, kind == "rms", 0)
    assert tiles.single_pass and tiles.block_m == 2 and programs == (3 if rows == 5 else 4)
    x = torch.randn(rows, 37, requires_grad=True)
    weight = torch.randn(37, requires_grad=True)
    bias = torch.randn(37, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias, config)
    _check(kind, x, None, bias, config)  # only db (LayerNorm), or no parameter gradient at all
    _check(kind, x, weight.detach(), bias, config)  # a frozen weight: db's partial rows come first


def test_ticket_counters_are_back_at_zero_after_every_backward():
    for config in (DEFAULT, LOOPED):
        x = torch.randn(41, 300, requires_grad=True)
        _check("layer", x, torch.randn(300, requires_grad=True), torch.randn(300, requires_grad=True), config)
        assert not norm_module._COUNTERS[("cpu", None, None)].any()


def test_launch_configs_are_data_with_a_default_for_every_architecture():
    assert norm_config(90) == NormConfig()  # the H100 measurements
    assert norm_config(0) == norm_config(75) == norm_config(120) == NormConfig()  # unknown: the defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.backward_tile = 1  # configs are values: tests and tuning pass a changed copy
    assert norm_module._picked_backward(torch.device("cpu"), 37, 5, 4, True) is norm_module._picked_backward(
        torch.device("cpu"), 37, 5, 4, True
    )  # one dict lookup per call


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
    # weight-gradient sum of these 1600-wide rows included (no opaque op call per launch).
    x = torch.randn(256, 1600, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(1600, device="cuda", dtype=dtype, requires_grad=True)

    def norm(x, weight):
        return rms_norm(x * 2, weight)

    def one_plus_weight_norm(x, weight):  # Gemma's: the offset reaches Inductor's launches too
        return rms_norm(x * 2, weight, 1e-6, weight_offset=1.0)

    check_against_float64(
        torch.compile(one_plus_weight_norm, fullgraph=True),
        lambda x, w: one_plus_weight_rms_norm(x * 2, w),
        (x, weight),
        ALLOWANCE[dtype],
    )
    compiled_code_launches(
        norm,
        (x, weight),
        kernels=("_norm_forward_kernel", "_norm_backward_kernel", "_sum_partials_kernel"),
        ops=("fastlm.norm_forward", "fastlm.norm_backward"),
    )
    check_against_float64(
        torch.compile(norm, fullgraph=True), lambda x, w: _torch_norm("rms")(x * 2, w), (x, weight), ALLOWANCE[dtype]
    )


def test_ops_pass_opcheck():
    x, weight = torch.randn(8, 40), torch.randn(40)
    torch.library.opcheck(norm_module._forward_op, (x, weight, None, 1e-5, True, torch.bfloat16))
    torch.library.opcheck(norm_module._forward_op, (x, weight, torch.randn(40), 1e-5, False, torch.float32))
    mean, rstd = x.mean(-1), torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
    torch.library.opcheck(norm_module._backward_op, (torch.randn(8, 40), x, weight, mean, rstd, False, True, True))
    # Gemma's (1 + weight): the offset through both ops
    torch.library.opcheck(norm_module._forward_op, (x, weight, None, 1e-6, True, torch.float32, 1.0))
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    torch.library.opcheck(norm_module._backward_op, (torch.randn(8, 40), x, weight, mean, rstd, True, True, False, 1.0))


def test_weight_offset_compiles_without_graph_breaks():
    x, weight = torch.randn(4, 48, requires_grad=True), torch.randn(48, requires_grad=True)
    norm = functools.partial(rms_norm, weight=weight, eps=1e-6, weight_offset=1.0)
    out = torch.compile(norm, fullgraph=True, backend="aot_eager")(x)
    out.sum().backward()
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6, weight_offset=1.0), rtol=1e-5, atol=1e-5)
    expected = torch.autograd.grad(rms_norm_ref(x, weight, 1e-6, weight_offset=1.0).sum(), (x, weight))
    torch.testing.assert_close((x.grad, weight.grad), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1024, 4096, 16384, 65536])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_bf16_and_wide_rows(kind, width):
    _check_gpu_bf16(kind, 64, width)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_wide_rows_in_chunks_of_several_rows(kind):
    # enough rows that every backward program gets chunks of 4 rows; a partial last one
    config = dataclasses.replace(_gpu_config(), looped_backward_rows=4)
    width, sms = 32768, torch.cuda.get_device_properties(0).multi_processor_count  # looped for both norms in bf16
    _, programs = backward_tiles(config, width, 1 << 20, 2, kind == "rms", sms)
    rows = 4 * programs + 3
    tiles, _ = backward_tiles(config, width, rows, 2, kind == "rms", sms)
    assert not tiles.single_pass and tiles.block_m == 4
    _check_gpu_bf16(kind, rows, width, config)


def _gpu_config():
    from fastlm.ops.common import device_arch

    return norm_config(device_arch(torch.device("cuda")))


def _check_gpu_bf16(kind, rows, width, config=None):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(width, device="cuda", dtype=torch.bfloat16, requires_grad=True) if kind == "layer" else None
    _check(kind, x, weight, bias, config)


def test_modules_match_torch():
    import fastlm.layers

    x = torch.randn(3, 24)
    torch.testing.assert_close(fastlm.layers.LayerNorm(24)(x), torch.nn.LayerNorm(24)(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fastlm.layers.RMSNorm(24, eps=1e-6)(x), torch.nn.RMSNorm(24, eps=1e-6)(x), rtol=1e-5, atol=1e-5
    )
    assert fastlm.layers.LayerNorm(24, bias=False).bias is None


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


# The dw / db sums inside the backward's launch under real concurrency (all single-pass widths summed
# there): hundreds of programs racing for the ticket counters. Every run must give the same bits
# (fixed-order sums) and match the reference. (8192, 1024): 2 programs per SM, in groups of 16 and
# of 2 (more counters than the first buffer holds); (257, 4000): 257 programs, a partial last group;
# (256, 65536): the wide rows' dw / db kernel, 128 column blocks x 16 row groups.
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "width", "sum_group"), [(8192, 1024, 16), (8192, 1024, 2), (257, 4000, 16), (256, 65536, 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_weight_gradients_summed_in_the_backward_are_exact_and_deterministic(kind, dtype, rows, width, sum_group):
    config = dataclasses.replace(_gpu_config(), fused_sum_max_d=1 << 20, fused_sum_group=sum_group)
    x = torch.randn(rows, width, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(width, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(width, device="cuda", dtype=dtype, requires_grad=True) if kind == "layer" else None
    leaves = [t for t in (x, weight, bias) if t is not None]
    dy = torch.randn_like(x)
    args = (x, weight) if kind == "rms" else (x, weight, bias)
    first = torch.autograd.grad(_norm(kind, config)(*args), leaves, dy)
    for _ in range(20):
        again = torch.autograd.grad(_norm(kind, config)(*args), leaves, dy)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    _check(kind, x, weight, bias, config)
    assert not any(counters.any() for counters in norm_module._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_gpu_eager_launches_match_tritons_dispatcher_bit_for_bit(kind, monkeypatch):
    # inputs 2 bytes past a 16-byte boundary, with an odd row stride, and a transposed (copied) one
    base = torch.randn(97 * 1001 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(97, 1001)[:, :999]
    cases = [x, torch.randn(999, 33, device="cuda", dtype=torch.bfloat16).t(), x[:1]]
    weight = torch.randn(999, device="cuda", dtype=torch.bfloat16)
    bias = None if kind == "rms" else torch.randn(999, device="cuda", dtype=torch.bfloat16)
    rms = kind == "rms"

    kernels = (norm_module._norm_forward_kernel, norm_module._norm_backward_kernel)

    def both_directions(x):
        y, mean, rstd = norm_module._forward(x, weight, bias, 1e-5, rms, x.dtype)
        grads = norm_module._backward(torch.ones_like(y), x, weight, mean, rstd, rms, True, not rms)
        return tuple(t for t in (y, rstd, *grads) if t is not None)

    for x in cases:
        with monkeypatch.context() as patch:  # each case starts on the direct launches again
            assert_direct_launch_matches_dispatcher(functools.partial(both_directions, x), kernels, patch)


@pytest.mark.gpu
def test_gpu_cuda_graphs_and_side_streams_keep_their_own_counters():
    x = torch.randn(4096, 768, device="cuda", requires_grad=True)
    weight = torch.randn(768, device="cuda", requires_grad=True)
    bias = torch.randn(768, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        return torch.autograd.grad(layer_norm(x, weight, bias), (x, weight, bias), dy)

    expected = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()  # on the default stream, with the counters it captured
        with torch.cuda.stream(side):
            on_side = step()  # beside it, with the side stream's counters
        on_default = step()  # after the replay, with the default stream's
        torch.cuda.synchronize()
        for grads in (captured, on_side, on_default):
            assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
