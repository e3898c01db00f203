"""Masked softmax kernels against an fp64 reference: outputs, gradients, masks, edge cases."""

import dataclasses

import pytest
import torch

import fastlm
from fastlm.ops import masked_softmax as softmax_module
from fastlm.ops.masked_softmax import MaskedSoftmaxFunction, masked_softmax, masked_softmax_config, masked_softmax_ref

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64, unit_roundoff

# (output, gradients): how far fastlm's normwise error may pass that of masked_softmax_ref (float64:
# the truth). fp32: sums taken in other orders. 16-bit outputs: an eighth of the unit roundoff, as
# both compute in fp32 and round once, at different points. 16-bit gradients: half of it, as the
# backward reads the output saved in the input's dtype (as torch.softmax's does), where the
# reference's graph keeps it in fp32: one rounding more.
ALLOWANCE = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (unit_roundoff(torch.float16) / 8, unit_roundoff(torch.float16) / 2),
    torch.bfloat16: (unit_roundoff(torch.bfloat16) / 8, unit_roundoff(torch.bfloat16) / 2),
}


def _check(x, mask=None, *, scale=1.0, causal=False, config=None):
    """Output and the gradients of x (and of the mask when it requires grad) against the reference,
    by `check_against_float64`; with ``config``, through the eager autograd.Function with that
    launch configuration."""
    out = check_against_float64(
        lambda x, mask: (
            MaskedSoftmaxFunction.apply(x, mask, scale, causal, config)
            if config is not None
            else masked_softmax(x, mask, scale=scale, causal=causal)
        ),
        lambda x, mask: masked_softmax_ref(x, mask, scale=scale, causal=causal),
        (x, mask),
        *ALLOWANCE[x.dtype],
    )
    assert out.dtype == x.dtype
    return out


@pytest.mark.parametrize("sk", [1, 7, 64, 300])
def test_plain_softmax_matches_torch(sk):
    x = torch.randn(2, 3, 5, sk, requires_grad=True)
    out = _check(x, scale=0.7)
    torch.testing.assert_close(out, torch.softmax(0.7 * x, dim=-1))


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 40), (1, 1, 9, 40), (9, 40), (2, 3, 9, 40), (40,)])
def test_additive_masks_broadcast(mask_shape):
    x = torch.randn(2, 3, 9, 40, requires_grad=True)
    mask = torch.where(torch.rand(mask_shape) < 0.3, float("-inf"), torch.randn(mask_shape))
    _check(x, mask, scale=0.5)


def test_mask_gradient_is_summed_over_broadcast_dims():
    x = torch.randn(2, 3, 9, 40, requires_grad=True)
    bias = torch.randn(1, 3, 1, 40, requires_grad=True)  # a learned per-head, per-key bias
    _check(x, bias, scale=2.0)


@pytest.mark.parametrize("sq,sk", [(16, 16), (5, 21), (21, 5)])
def test_causal(sq, sk):
    x = torch.randn(2, 2, sq, sk, requires_grad=True)
    out = _check(x, causal=True)
    # bottom-right alignment: query i sees keys j <= i + (sk - sq)
    hidden = ~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    assert (out[..., hidden] == 0).all()


def test_causal_with_a_padding_mask():
    x = torch.randn(2, 4, 12, 12, requires_grad=True)
    padding = torch.zeros(2, 1, 1, 12)
    padding[1, ..., 8:] = float("-inf")  # the second sequence has 8 real tokens
    _check(x, padding, causal=True, scale=0.125)


def test_fully_masked_rows_are_zero_with_zero_gradient():
    x = torch.randn(3, 10, requires_grad=True)
    mask = torch.zeros(3, 10)
    mask[1] = float("-inf")
    out = masked_softmax(x, mask)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    torch.testing.assert_close(out[[0, 2]].sum(-1), torch.ones(2))
    (grad,) = torch.autograd.grad(out, x, torch.randn_like(out))
    assert torch.isfinite(grad).all() and (grad[1] == 0).all()
    # causal with more queries than keys: the first queries see nothing
    out = masked_softmax(torch.randn(1, 6, 3), causal=True)
    assert (out[0, :3] == 0).all() and torch.allclose(out[0, 3:].sum(-1), torch.ones(3))


# Row 0 holds +inf, row 1 NaN, row 2 -inf, row 3 nothing special: torch.softmax gives NaN rows 0 and
# 1, and finite rows 2 and 3 (0 at the -inf). Through the single-pass kernel, the looped one (blocks
# of 64 over 300 keys), and the plain-PyTorch path.
@pytest.mark.parametrize("path", ["single pass", "looped", "reference"])
def test_nan_and_inf_follow_torch(path, monkeypatch):
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = dataclasses.replace(softmax_module.DEFAULT_CONFIG, block_max=64) if path == "looped" else None
    x = torch.randn(4, 300)
    x[0, 5], x[1, 170], x[2, 9] = float("inf"), float("nan"), -float("inf")
    out = MaskedSoftmaxFunction.apply(x, None, 1.0, False, config)
    expected = torch.softmax(x, dim=-1)
    assert out.isnan().sum(-1).tolist() == [300, 300, 0, 0]
    torch.testing.assert_close(out, expected, equal_nan=True)
    mask = torch.zeros(4, 300)
    mask[3, 0] = float("nan")  # a NaN bias poisons its row too, and so does +inf added to a -inf score
    mask[2, 9] = float("inf")
    out = MaskedSoftmaxFunction.apply(x, mask, 1.0, False, config)
    assert out.isnan().all(-1).tolist() == [True, True, True, True]


@pytest.mark.parametrize("causal", [False, True])
def test_long_rows_take_the_looped_path(causal):
    config = dataclasses.replace(softmax_module.DEFAULT_CONFIG, block_max=64)  # 300 keys: 5 chunks of 64
    assert not config.tiles(300).single_pass and config.tiles(300).block_d == 64  # the last chunk partial
    x = torch.randn(1, 2, 7, 300, requires_grad=True)
    mask = torch.where(torch.rand(1, 1, 1, 300) < 0.2, float("-inf"), 0.0)
    mask[..., :100] = float("-inf")  # the first chunks fully masked: the online max starts at -inf
    _check(x, mask, causal=causal, scale=0.3, config=config)
    _check(x, mask.requires_grad_(), causal=causal, scale=0.3, config=config)  # dmask: the backward at scale 1


def test_small_tiles_stack_rows():
    # 40-key rows in 256-element tiles: 4 rows of 64 per program over 2*3*9 = 54 rows, the last
    # program partial; 64 elements per warp: 4 warps
    config = dataclasses.replace(softmax_module.DEFAULT_CONFIG, tile=256, per_warp=64)
    tiles = config.tiles(40)
    assert (tiles.block_m, tiles.block_d, tiles.single_pass, tiles.num_warps) == (4, 64, True, 4)
    _check(torch.randn(2, 3, 9, 40, requires_grad=True), torch.randn(1, 3, 1, 40), scale=0.5, config=config)


def test_config_for_every_architecture():
    # measured on sm90; any other architecture and the interpreter (0) get the default, never an error
    for arch in (0, 75, 80, 90, 100, 120):
        assert masked_softmax_config(arch, torch.bfloat16).tiles(65536).block_d <= 65536
    assert masked_softmax_config(75, torch.float32) == softmax_module.DEFAULT_CONFIG


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    x = (torch.randn(2, 4, 8, 96) * 4).to(dtype).requires_grad_()
    _check(x, torch.zeros(1, 1, 8, 96, dtype=dtype), causal=True)


def test_non_contiguous_input():
    base = torch.randn(2, 9, 3, 40)
    x = base.transpose(1, 2).requires_grad_()  # (2, 3, 9, 40) with permuted strides
    assert not x.is_contiguous()
    _check(x, torch.zeros(2, 1, 1, 40), scale=1.5)


@pytest.mark.parametrize("shape", [(40,), (5, 6, 2, 3, 7)])
def test_any_rank(shape):
    _check(torch.randn(shape, requires_grad=True))


def test_properties():
    x = torch.randn(4, 6, 50)
    out = masked_softmax(x)
    torch.testing.assert_close(out.sum(-1), torch.ones(4, 6))
    assert (out >= 0).all()
    torch.testing.assert_close(masked_softmax(x + 123.0), out)  # shift invariance
    assert fastlm.masked_softmax is masked_softmax


def test_compiles_without_graph_breaks():
    x = torch.randn(2, 3, 8, 16, requires_grad=True)
    mask = torch.zeros(2, 1, 1, 16)

    def fn(x, mask):
        return masked_softmax(x, mask, scale=0.25, causal=True).square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(x, mask), x)
    (want,) = torch.autograd.grad(fn(x, mask), x)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sk", [1024, 4096, 65536])
def test_gpu_matches_reference(dtype, sk):
    x = torch.randn(2, 4, 8, sk, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.where(torch.rand(2, 1, 1, sk, device="cuda") < 0.1, float("-inf"), 0.0).to(dtype)
    _check(x, mask, scale=0.125)
    _check(x, causal=True)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    x = torch.randn(2, 4, 64, 256, device="cuda", requires_grad=True)
    mask = torch.where(torch.rand(2, 1, 1, 256, device="cuda") < 0.1, float("-inf"), 0.0)
    out = compiled_code_launches(
        lambda x: masked_softmax(x * 2, mask, scale=0.5, causal=True).square(),
        (x,),
        kernels=("_softmax_forward_kernel", "_softmax_backward_kernel"),
        ops=("fastlm.masked_softmax_forward", "fastlm.masked_softmax_backward"),
    )
    expected = masked_softmax_ref(x * 2, mask, scale=0.5, causal=True)
    torch.testing.assert_close(out, expected.square(), rtol=1e-5, atol=1e-6)
    (want,) = torch.autograd.grad(expected.square().sum(), x)
    torch.testing.assert_close(x.grad, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gpu_direct_launch_matches_tritons_dispatcher(monkeypatch):
    kernels = (softmax_module._softmax_forward_kernel, softmax_module._softmax_backward_kernel)

    def forward_and_grad(x, mask):
        out = masked_softmax(x, mask, scale=0.3, causal=True)
        return out, *torch.autograd.grad(out, x, torch.ones_like(out).cumsum(-1))

    mask = torch.randn(2, 1, 1, 37, device="cuda")
    forward_and_grad(torch.randn(2, 3, 5, 37, device="cuda", requires_grad=True), mask)  # aligned binaries first
    # x 4 bytes past a 16-byte boundary with odd strides (and permuted), the mask too
    x = torch.randn(2 * 5 * 3 * 41 + 1, device="cuda")[1:].view(2, 5, 3, 41)[..., :37].transpose(1, 2)
    x.requires_grad_()
    mask = torch.randn(2 * 39 + 1, device="cuda")[1:].view(2, 1, 1, 39)[..., :37]
    assert_direct_launch_matches_dispatcher(lambda: forward_and_grad(x, mask), kernels, monkeypatch)


@pytest.mark.gpu
def test_gpu_compiles_with_dynamic_shapes():
    # sizes are SymInts inside the traced launchers: nothing may hash them (the config caches)
    def fn(x, mask):
        return masked_softmax(x, mask, scale=0.25, causal=True).square().sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for sq in (64, 100):
        x = torch.randn(2, 3, sq, 128, device="cuda", requires_grad=True)
        mask = torch.randn(2, 1, 1, 128, device="cuda")
        (got,) = torch.autograd.grad(compiled(x, mask), x)
        (want,) = torch.autograd.grad(fn(x, mask), x)
        torch.testing.assert_close(got, want)


def test_ops_pass_opcheck():
    x, mask = torch.randn(2, 3, 5, 7), torch.zeros(2, 1, 1, 7)
    torch.library.opcheck(softmax_module._forward_op, (x, mask, 0.5, True))
    y = masked_softmax(x, mask)
    torch.library.opcheck(softmax_module._backward_op, (torch.randn_like(y), y, 0.5))
