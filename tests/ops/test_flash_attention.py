"""fastlm.flash_attention and its two autograd.Functions against a float64 reference.

Output and every gradient are compared on fresh random inputs. On CPU the Triton kernels run
through the interpreter on small shapes; the `gpu` tests repeat the checks at a few thousand
tokens with tight tolerances, and check bit-for-bit reproducible gradients.
"""

import contextvars
import dataclasses
import math
import re

import pytest
import torch
import triton

import fastlm
from fastlm.ops.common import device_arch
from fastlm.ops.flash_attention import (
    MAX_HEAD_DIM,
    SHORT_SEQ,
    SM90_SHORT_TILES,
    AttentionConfig,
    AttentionTiles,
    FlashAttentionTorch,
    FlashAttentionTriton,
    attention_config,
    flash_attention_ref,
)
from fastlm.ops.flash_attention.api import _backward_op, _forward_op
from fastlm.ops.flash_attention.kernels import (
    _flash_backward_dkdv_kernel,
    _flash_backward_dq_kernel,
    _flash_forward_kernel,
)

from .launches import assert_direct_launch_matches_dispatcher, compiled_code_launches
from .reference import check_against_float64, unit_roundoff

# (batch, heads, kv heads, Nq, Nk, head dim). Tiles are 64-128 rows (attention_config), so 131 and
# 200 run a whole tile, a masked diagonal tile and a partial last tile; 37 is a prime inside one
# tile; 1 is the degenerate length. Nq > Nk (causal) leaves the first Nq - Nk rows with no key.
CASES = [
    pytest.param(1, 1, 1, 1, 1, 16, id="len1"),
    pytest.param(1, 2, 1, 37, 37, 16, id="prime-gqa2"),
    pytest.param(2, 2, 2, 131, 131, 32, id="just-above-tile"),
    pytest.param(1, 4, 2, 200, 150, 64, id="nq>nk-gqa2"),
    pytest.param(1, 1, 1, 150, 200, 96, id="nq<nk-d96"),
    pytest.param(1, 2, 1, 70, 300, 128, id="many-key-tiles-d128"),
]

# (output, gradients): how far fastlm's normwise error may pass that of flash_attention_ref rounded
# to the inputs' dtype (float64: the truth). fp32: IEEE fp32 matmuls summing in other orders. 16-bit
# outputs: a quarter of the unit roundoff, as the kernel rounds P to the input dtype before P @ V
# (as FlashAttention does on tensor cores), where the reference keeps it in fp32. 16-bit gradients:
# a whole unit roundoff, as dS = P * (dP - rowsum(dO * O)) also reads the output saved in the input
# dtype, and is rounded before both of its matmuls (dQ = dS K, dK = dS^T Q).
ALLOWANCE = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (unit_roundoff(torch.float16) / 4, unit_roundoff(torch.float16)),
    torch.bfloat16: (unit_roundoff(torch.bfloat16) / 4, unit_roundoff(torch.bfloat16)),
}


def make_qkv(batch, heads, kv_heads, nq, nk, dim, dtype, device, requires_grad=True):
    q = torch.randn(batch, heads, nq, dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, nk, dim, device=device, dtype=dtype)
    v = torch.randn(batch, kv_heads, nk, dim, device=device, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def check_attention(run, q, k, v, causal, scale=None, window=None, softcap=None):
    """``run(q, k, v)``'s output and (dq, dk, dv) against the materialized reference, by
    `check_against_float64`."""
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    out = check_against_float64(
        run,
        lambda q, k, v: flash_attention_ref(q, k, v, **options).to(q.dtype),
        (q, k, v),
        *ALLOWANCE[q.dtype],
    )
    assert out.dtype == q.dtype


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,heads,kv_heads,nq,nk,dim", CASES)
def test_triton_matches_reference_fp32(batch, heads, kv_heads, nq, nk, dim, causal, device):
    q, k, v = make_qkv(batch, heads, kv_heads, nq, nk, dim, torch.float32, device)
    check_attention(lambda *a: FlashAttentionTriton.apply(*a, causal), q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,nq,nk,dim", [CASES[1], CASES[3], CASES[4]])
def test_triton_half_precision(batch, heads, kv_heads, nq, nk, dim, dtype, device):
    q, k, v = make_qkv(batch, heads, kv_heads, nq, nk, dim, dtype, device)
    check_attention(lambda *a: FlashAttentionTriton.apply(*a, True), q, k, v, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,heads,kv_heads,nq,nk,dim", CASES)
def test_torch_twin_matches_reference(batch, heads, kv_heads, nq, nk, dim, causal):
    q, k, v = make_qkv(batch, heads, kv_heads, nq, nk, dim, torch.float32, "cpu")
    check_attention(lambda *a: FlashAttentionTorch.apply(*a, causal), q, k, v, causal)


@pytest.mark.parametrize(
    "causal,window", [(False, None), (True, None), (False, (20, 3))], ids=["full", "causal", "window"]
)
@pytest.mark.parametrize("batch,heads,kv_heads,nq,nk,dim", CASES)
def test_eager_cpu_path_matches_reference(batch, heads, kv_heads, nq, nk, dim, causal, window, monkeypatch):
    """The public function on CPU tensors without the interpreter (torch's SDPA under fastlm's
    masks, sdpa.py): bottom-right causal rows, grouped heads, rows that see no key."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_qkv(batch, heads, kv_heads, nq, nk, dim, torch.float32, "cpu")
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=causal, window=window), q, k, v, causal, window=window)


# softcap 0.5 over scaled scores of about +-1 (randn q and k at head dim 16): the cap bends most of
# them, so the softcapped attention is far from the plain one
@pytest.mark.parametrize("path", ["device", "eager-cpu"])
@pytest.mark.parametrize("causal,window", [(True, None), (False, (5, 2))], ids=["causal", "window"])
def test_softcap_matches_reference(path, causal, window, device, monkeypatch):
    """On the device's path (the kernels, or the interpreter on a CPU) and on the eager CPU path,
    which takes the tiled twin for softcapped scores (SDPA has no softcap)."""
    if path == "eager-cpu":
        device = torch.device("cpu")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_qkv(1, 4, 2, 37, 37, 16, torch.float32, device)
    options = dict(causal=causal, window=window)
    check_attention(lambda *a: fastlm.flash_attention(*a, **options, softcap=0.5), q, k, v, **options, softcap=0.5)
    with torch.no_grad():
        capped, plain = (fastlm.flash_attention(q, k, v, **options, softcap=c) for c in (0.5, None))
    assert (capped - plain).abs().max() > 0.1


def test_a_wide_softcap_changes_nothing(device):
    """A cap of 1e6 over scores of about +-1: c tanh(s / c) is s to fp32's precision, so the output
    is the plain one (tanh's small arguments taken by its series, not a form that cancels)."""
    q, k, v = make_qkv(1, 4, 2, 37, 37, 16, torch.float32, device, requires_grad=False)
    capped, plain = (fastlm.flash_attention(q, k, v, causal=True, softcap=c) for c in (1e6, None))
    torch.testing.assert_close(capped, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), "1"])
def test_softcap_must_be_a_positive_number(softcap, device):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, device, requires_grad=False)
    with pytest.raises((TypeError, ValueError), match="softcap"):
        fastlm.flash_attention(q, k, v, softcap=softcap)


def test_eager_cpu_path_takes_3d_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = make_qkv(2, 1, 1, 45, 45, 32, torch.float32, "cpu")
    squeezed = [t.detach()[:, 0].requires_grad_() for t in (q, k, v)]
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=True), *squeezed, True)


@pytest.mark.parametrize("function", [FlashAttentionTorch, FlashAttentionTriton])
def test_saves_exactly_l_q_k_v_o_on_3d_inputs(function, device):
    """The 3-D interface: saved tensors are (L, Q, K, V, O), L of shape (B, Nq) in fp32 and equal
    to the logsumexp of the scaled scores."""
    if function is FlashAttentionTorch:
        device = torch.device("cpu")
    q, k, v = (torch.randn(2, 45, 32, device=device, requires_grad=True) for _ in range(3))
    out = function.apply(q, k, v, True)
    lse, *qkvo = out.grad_fn.saved_tensors
    assert all(a is b for a, b in zip(qkvo, (q, k, v), strict=False)) and torch.equal(qkvo[3], out)
    assert lse.shape == (2, 45) and lse.dtype == torch.float32
    scores = (q.double() @ k.double().transpose(1, 2)) / math.sqrt(32)
    scores = scores.masked_fill(torch.ones(45, 45, dtype=torch.bool, device=device).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_rows_without_visible_keys_return_zero(device):
    """Causal with Nq > Nk: the first Nq - Nk queries see no key; output 0, finite gradients."""
    q, k, v = make_qkv(1, 1, 1, 20, 5, 16, torch.float32, device)
    out = fastlm.flash_attention(q, k, v, causal=True)
    assert torch.equal(out[0, 0, :15], torch.zeros(15, 16, device=device))
    lse = out.grad_fn.saved_tensors[0]
    assert torch.isneginf(lse[0, 0, :15]).all() and torch.isfinite(lse[0, 0, 15:]).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("run", ["kernels", "tiled twin", "reference"])
def test_nan_and_inf_follow_torch(run, device):
    """A NaN or +inf in a query row, or +inf in a key, makes the rows whose scores it reaches NaN, as
    torch's softmax(q k^T) v does; the other rows stay exact."""
    q, k, v = make_qkv(1, 1, 1, 20, 20, 16, torch.float32, device, requires_grad=False)
    q[0, 0, 3, 2], q[0, 0, 5, 1], k[0, 0, 7, 0] = float("inf"), float("nan"), float("inf")
    attend = {
        "kernels": FlashAttentionTriton.apply,
        "tiled twin": FlashAttentionTorch.apply,
        "reference": flash_attention_ref,
    }[run]
    out = attend(q, k, v)
    expected = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4, dim=-1) @ v.double()
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().any()
    torch.testing.assert_close(out.double(), expected, equal_nan=True, atol=1e-5, rtol=1e-5)


def test_functional_3d_4d_scale_and_noncontiguous(device):
    """(B, N, H, D) memory viewed as (B, H, N, D): kernels follow strides; results in (B, N, H, D)
    memory; explicit scale honoured."""
    q, k, v = (torch.randn(2, 50, 3, 32, device=device).transpose(1, 2).requires_grad_(True) for _ in range(3))
    assert not q.is_contiguous()
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=True, scale=0.3), q, k, v, True, scale=0.3)
    # the output in (B, N, H, D) memory whatever the inputs' layout: the model's transpose back to
    # (B, N, H * D) is a view; the gradients contiguous where their inputs are (dk and dv where k and
    # v both are), so leaves take them without a copy, else token-major
    contiguous = make_qkv(2, 4, 2, 50, 50, 32, torch.float32, device)
    token_major = [torch.randn(2, 50, h, 32, device=device).transpose(1, 2).requires_grad_(True) for h in (4, 2)]
    for inputs, laid_out in (
        ((q, k, v), (False, False, False)),
        (contiguous, (True, True, True)),
        ((token_major[0], *contiguous[1:]), (False, True, True)),
        ((contiguous[0], token_major[1], contiguous[2]), (True, False, False)),
    ):
        out = fastlm.flash_attention(*inputs, causal=True)
        assert out.transpose(1, 2).is_contiguous()
        grads = torch.autograd.grad(out, inputs, torch.randn_like(out))
        for grad, contiguous_grad in zip(grads, laid_out, strict=True):
            assert grad.is_contiguous() if contiguous_grad else grad.transpose(1, 2).is_contiguous()
    q3, k3, v3 = (torch.randn(3, 40, 16, device=device, requires_grad=True) for _ in range(3))
    check_attention(lambda *a: fastlm.flash_attention(*a), q3, k3, v3, False)


@pytest.mark.parametrize("shape", [(1, 2, 20, 16), (2, 20, 16)], ids=["4d-grouped", "3d"])
def test_traced_results_have_the_kernels_layouts(shape, device):
    """torch.compile sizes the ops' results from a traced run (fake tensors: the tiled twin on a CPU,
    the launchers on a GPU); their shapes and strides must be those the kernels return."""
    q = torch.randn(shape, device=device)
    k, v = (
        torch.randn(*shape[:-3], 1, *shape[-2:], device=device)
        if len(shape) == 4
        else torch.randn(shape, device=device)
        for _ in range(2)
    )
    causal = (None, None, 20, True, 0.25, 19, 0)  # no documents, 20 keys, causal, scale, window (19, 0)
    torch.library.opcheck(_forward_op, (q, k, v, *causal), test_utils=("test_faketensor",))
    o, lse = _forward_op(q, k, v, *causal)
    torch.library.opcheck(
        _backward_op, (torch.randn_like(o), q, k, v, o, lse, *causal), test_utils=("test_faketensor",)
    )


def test_head_dim_256_and_odd_dims(device):
    for dim in (8, 200, 256):
        q, k, v = make_qkv(1, 1, 1, 33, 33, dim, torch.float32, device)
        check_attention(lambda *a: fastlm.flash_attention(*a, causal=True), q, k, v, True)


def test_backward_is_deterministic(device):
    q, k, v = make_qkv(1, 4, 2, 150, 150, 64, torch.float32, device)
    grad_out = torch.randn(q.shape, device=device)
    first = torch.autograd.grad(fastlm.flash_attention(q, k, v, causal=True), (q, k, v), grad_out)
    second = torch.autograd.grad(fastlm.flash_attention(q, k, v, causal=True), (q, k, v), grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# (batch, heads, kv heads, Nq, Nk, causal, window, layout) at head dim 128, where the 16-bit forward
# loads through TMA descriptors: partial last tiles both ways (Nq < Nk, and Nq > Nk with rows that
# see no key), grouped heads, a window, token-major views, 3-D inputs, and inputs one element off
# 16-byte alignment (these take the pointer loads).
DESCRIPTOR_CASES = [
    pytest.param(1, 2, 1, 70, 300, True, None, "contiguous", id="nq<nk-gqa2"),
    pytest.param(1, 1, 1, 200, 150, True, None, "contiguous", id="nq>nk"),
    pytest.param(2, 2, 2, 131, 131, False, (20, 5), "token-major", id="window-token-major"),
    pytest.param(2, 1, 1, 131, 131, True, None, "3d", id="3d"),
    pytest.param(1, 2, 2, 70, 70, True, None, "misaligned", id="misaligned"),
]


def descriptor_inputs(batch, heads, kv_heads, nq, nk, layout, dtype, device):
    def one(rows, h):
        if layout == "3d":
            return torch.randn(batch, rows, 128, device=device, dtype=dtype)
        if layout == "misaligned":
            memory = torch.randn(batch * h * rows * 128 + 1, device=device, dtype=dtype)[1:]
            return memory.view(batch, h, rows, 128)
        if layout == "token-major":
            return torch.randn(batch, rows, h, 128, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, h, rows, 128, device=device, dtype=dtype)

    return [one(rows, h).requires_grad_(True) for rows, h in ((nq, heads), (nk, kv_heads), (nk, kv_heads))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,kv_heads,nq,nk,causal,window,layout", DESCRIPTOR_CASES)
def test_forward_through_descriptors_gives_the_pointer_forwards_bits(
    batch, heads, kv_heads, nq, nk, causal, window, layout, dtype, device, monkeypatch
):
    """The default 16-bit head-dim-128 config loads the forward's tiles through descriptors where the
    inputs allow: the same bits as the pointer loads at the same tiles, gradients as the reference."""
    from fastlm.ops.flash_attention import launchers

    q, k, v = descriptor_inputs(batch, heads, kv_heads, nq, nk, layout, dtype, device)
    with_descriptors = attention_config(device_arch(q.device), dtype, 128)
    if not with_descriptors.forward_descriptors:
        pytest.skip("this GPU has no TMA")
    pointers = dataclasses.replace(with_descriptors, forward_descriptors=False)
    fits, real_fit = [], launchers._descriptors_fit

    def recorded_fit(*args):
        fits.append(real_fit(*args))
        return fits[-1]

    monkeypatch.setattr(launchers, "_descriptors_fit", recorded_fit)

    def attend(config):
        return lambda *a: FlashAttentionTriton.apply(*a, causal, None, config, window)

    assert torch.equal(attend(with_descriptors)(q, k, v), attend(pointers)(q, k, v))
    assert fits == [layout != "misaligned"]  # asked once: the pointer config never asks
    check_attention(attend(with_descriptors), q, k, v, causal, window=window)


def test_a_descriptor_launch_finds_a_scratch_allocator_and_keeps_the_users(monkeypatch):
    """An eager launch through descriptors finds the launcher's scratch allocator in Triton's context
    for itself only: a user's allocator is back in place after it, and a pointer launch sees the
    user's. A traced launch runs later (aot_eager launches through Triton's own launcher): it keeps
    a user's allocator, and where none was set, sets the launcher's."""
    from triton.runtime import _allocation

    from fastlm.ops.flash_attention import launchers

    seen = []

    class Recorder:  # stands for the kernel: what the launch would see
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((kwargs["TMA"], _allocation._allocator.get()))

    monkeypatch.setattr(launchers, "_launch_flash_forward", lambda traced: Recorder())
    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16) for _ in range(3))
    config = attention_config(0, torch.bfloat16, 128)

    def user_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    def launches():
        triton.set_allocator(user_allocator)
        for traced in (False, True):
            launchers._launch_forward(q, k, v, True, 0.1, config, traced=traced)
        launchers._launch_forward(q, k, v, True, 0.1, dataclasses.replace(config, forward_descriptors=False))
        return _allocation._allocator.get()

    assert contextvars.copy_context().run(launches) is user_allocator  # a context of its own: no leak
    assert seen == [(True, launchers._scratch), (True, user_allocator), (False, user_allocator)]

    def traced_launch_without_an_allocator():
        launchers._launch_forward(q, k, v, True, 0.1, config, traced=True)
        return _allocation._allocator.get()

    fresh = contextvars.Context()  # Triton's default: its NullAllocator, which raises when called
    assert fresh.run(traced_launch_without_an_allocator) is launchers._scratch


def test_descriptors_fit_a_traced_tensor_by_its_storage_offset():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastlm.ops.flash_attention.launchers import _descriptors_fit

    with FakeTensorMode():  # no addresses: the storage offset decides
        rows = torch.empty(2, 64, 128, dtype=torch.bfloat16)
        assert _descriptors_fit(rows, rows[:, 1:], rows.transpose(0, 1))
        assert not _descriptors_fit(rows.view(-1)[1 : 1 + 64 * 128].view(64, 128))  # one element off
        assert not _descriptors_fit(rows[..., :100:2])  # stride 2 along D


# Tiles far smaller than the defaults: at 70 x 50 every kernel runs several whole, diagonal and
# partial tiles (no length a multiple of 16), with different tile shapes in each direction (fp32
# tl.dot needs edges >= 16).
SMALL_TILES = AttentionConfig(
    forward=AttentionTiles(16, 32, 4, 1), dkdv=AttentionTiles(32, 16, 4, 1), dq=AttentionTiles(16, 16, 2, 1)
)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_explicit_config_matches_reference(causal, device):
    # grouped heads, and Nq > Nk: causal leaves the first 20 rows without a key
    q, k, v = make_qkv(1, 2, 1, 70, 50, 32, torch.float32, device)
    check_attention(lambda *a: FlashAttentionTriton.apply(*a, causal, None, SMALL_TILES), q, k, v, causal)
    out = FlashAttentionTriton.apply(q, k, v, causal, None, SMALL_TILES)
    assert out.grad_fn.options[-1] is SMALL_TILES  # the backward launches with the forward's tiles


def test_config_with_one_direction_replaced(device):
    """Tuning replaces one kernel's tiles of the default config (benchmarks/tune_attention.py)."""
    q, k, v = make_qkv(1, 2, 1, 70, 70, 16, torch.float32, device)
    config = dataclasses.replace(attention_config(0, torch.float32, 16), dkdv=AttentionTiles(16, 32, 4, 1))
    check_attention(lambda *a: FlashAttentionTriton.apply(*a, True, None, config), q, k, v, True)


# (Nq, Nk, causal, window), run with SMALL_TILES: windows narrower than a tile (masked inside it,
# whole tiles skipped on both sides), of 0 and 1 keys, one-sided, Nq != Nk (aligned bottom-right:
# with 61 queries and 45 keys the first 13 rows see no key), and wider than the sequence.
WINDOWS = [
    pytest.param(70, 70, True, (7, -1), id="causal-left7"),
    pytest.param(70, 70, False, (0, 2), id="left0-right2"),
    pytest.param(70, 70, False, (1, 1), id="band1"),
    pytest.param(61, 45, False, (20, 3), id="nq>nk-20-3"),
    pytest.param(45, 61, False, (-1, 2), id="nq<nk-right2"),
    pytest.param(70, 70, True, (200, -1), id="wider-than-sequence"),
]


@pytest.mark.parametrize("nq,nk,causal,window", WINDOWS)
def test_window_matches_reference(nq, nk, causal, window, device):
    q, k, v = make_qkv(1, 2, 1, nq, nk, 16, torch.float32, device)
    check_attention(
        lambda *a: FlashAttentionTriton.apply(*a, causal, None, SMALL_TILES, window), q, k, v, causal, window=window
    )


@pytest.mark.parametrize("nq,nk,causal,window", WINDOWS)
def test_torch_twin_window_matches_reference(nq, nk, causal, window):
    q, k, v = make_qkv(1, 2, 1, nq, nk, 16, torch.float32, "cpu")
    check_attention(lambda *a: FlashAttentionTorch.apply(*a, causal, None, window), q, k, v, causal, window=window)


@pytest.mark.parametrize("run", ["kernels", "tiled twin"])
def test_window_of_the_diagonal_returns_each_rows_own_value(run, device):
    """Causal with a left window of 0 (causal bounds the right at 0, whatever the window says): each
    query sees its own key alone, so O = V and dV = dO exactly, and dQ = dK = 0 up to the rounding of
    dS = P * (dP - rowsum(dO * O)), a difference of two equal dot products."""
    attend = {
        "kernels": lambda *a: FlashAttentionTriton.apply(*a, True, None, SMALL_TILES, (0, 5)),
        "tiled twin": lambda *a: FlashAttentionTorch.apply(*a, True, None, (0, 5)),
    }[run]
    q, k, v = make_qkv(1, 2, 2, 70, 70, 16, torch.float32, device if run == "kernels" else "cpu")
    grad_out = torch.randn_like(q)
    out = attend(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    assert torch.equal(out, v) and torch.equal(dv, grad_out)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5


def test_window_never_reads_tiles_outside_it(device):
    """NaN in the values of the first 16 keys reaches (as 0 * NaN) the rows of every program that
    loads them. With a causal window of 16 keys and SMALL_TILES no program loads them for queries
    from 48 on, nor for the dK/dV of keys from 64 on (their query tiles start at 48, where Dlt of
    rows 32..47 is NaN): those results must equal the reference on the same inputs, NaN-free."""
    q, k, v = make_qkv(1, 2, 1, 96, 96, 16, torch.float32, device)
    grad_out = torch.randn(q.shape, device=device)
    poisoned = v.detach().clone()
    poisoned[:, :, :16] = float("nan")
    out = FlashAttentionTriton.apply(q, k, poisoned.requires_grad_(True), True, None, SMALL_TILES, (16, -1))
    got = (out, *torch.autograd.grad(out, (q, k, poisoned), grad_out))
    doubles = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = flash_attention_ref(*doubles, causal=True, window=(16, -1))
    want = (ref, *torch.autograd.grad(ref, doubles, grad_out.double()))
    for name, a, b, first in zip(("out", "dq", "dk", "dv"), got, want, (48, 48, 64, 64), strict=True):
        torch.testing.assert_close(a[:, :, first:].double(), b[:, :, first:], atol=1e-5, rtol=1e-5, msg=name)
    assert out[:, :, :16].isnan().all()  # the rows that see the NaN


def test_attention_config_covers_every_arch_dtype_and_head_dim():
    """Other GPUs (80, 120) and the interpreter (0) get the sm90 tiles, never an error, for long and
    short sequences alike, and GPUs without TMA (80) a forward through pointers; cached."""
    for arch in (0, 80, 90, 120):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for dim in range(1, MAX_HEAD_DIM + 1):
                for keys in (None, 1, SHORT_SEQ, SHORT_SEQ + 1):
                    config, sm90 = attention_config(arch, dtype, dim, keys), attention_config(90, dtype, dim, keys)
                    if arch == 80:
                        sm90 = dataclasses.replace(sm90, forward_descriptors=False)
                    assert config == sm90 and isinstance(config, AttentionConfig)
    assert attention_config(90, torch.bfloat16, 128) is attention_config(90, torch.bfloat16, 128)
    assert attention_config(90, torch.bfloat16, 128).forward == AttentionTiles(128, 128, 8, 3)  # tuned on sm90
    assert attention_config(90, torch.bfloat16, 128).forward_descriptors
    assert not attention_config(90, torch.bfloat16, 64).forward_descriptors
    long = attention_config(90, torch.bfloat16, 64, SHORT_SEQ + 1)
    assert attention_config(90, torch.bfloat16, 64) is long
    assert attention_config(90, torch.bfloat16, 64, SHORT_SEQ) == SM90_SHORT_TILES.get((64, 2), long)


def test_outputs_are_fully_written(device):
    """Outputs come from torch.empty; poison the caching allocator's blocks with NaN first so any
    element a kernel fails to write shows up."""
    for _ in range(4):
        torch.full((1, 3, 77, 64), float("nan"), device=device)
    q, k, v = make_qkv(1, 3, 3, 77, 77, 64, torch.float32, device)
    out = fastlm.flash_attention(q, k, v, causal=True)
    out.backward(torch.randn_like(out))
    assert all(torch.isfinite(t).all() for t in (out, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("heads", [2, 0], ids=["4d-gqa2", "3d"])  # 0: 3-D inputs, read as one head
def test_registered_ops_pass_opcheck(heads, device):
    q, k, v = make_qkv(1, 2, 1, 40, 40, 32, torch.float32, device)
    if not heads:
        q, k, v = (t.detach()[:, 0].requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.fastlm.flash_attention_forward, (q, k, v, None, None, 0, True, 0.2, 3, -1))


class TinyAttention(torch.nn.Module):
    """A module with projections around the kernel, as a model would use it: dense causal attention,
    and the same tokens as packed documents under a causal sliding window."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, cu_seqlens):
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        dense = fastlm.flash_attention(q, k, v, causal=True)
        q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))  # (batch * length, heads, head dim)
        packed = fastlm.flash_attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, length, length, causal=True, window=(5, -1)
        )
        return dense.sum() + packed.square().sum()


def test_torch_compile_fullgraph(device):
    model = TinyAttention().to(device)
    x = torch.randn(2, 24, 32, device=device)
    cu_seqlens = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32, device=device)  # documents across rows
    expected = model(x, cu_seqlens)
    expected.backward()
    expected_grad = model.qkv.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    actual = compiled(x, cu_seqlens)
    actual.backward()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.qkv.weight.grad, expected_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    q, k, v = make_qkv(2, 4, 4, 256, 256, 64, torch.bfloat16, "cuda")
    kernels = ("_flash_forward_kernel", "_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel")

    def attend(q, k, v):
        return fastlm.flash_attention(q * 2, k, v, causal=True)

    compiled_code_launches(
        attend, (q, k, v), kernels=kernels, ops=("fastlm.flash_attention_forward", "fastlm.flash_attention_backward")
    )
    check_against_float64(
        torch.compile(attend, fullgraph=True),
        lambda q, k, v: flash_attention_ref(q * 2, k, v, causal=True).to(q.dtype),
        (q, k, v),
        *ALLOWANCE[torch.bfloat16],
    )


# --- GPU: realistic lengths, tight tolerances --------------------------------------------------


# Every head dim in bf16 (causal: both kernel stages); the other dtypes and the unmasked kernel
# at the model head dims. Each triple compiles its own kernels, so the grid is chosen, not crossed.
GPU_CASES = [(d, torch.bfloat16, True) for d in (16, 32, 64, 96, 128, 256)] + [
    (128, torch.bfloat16, False),
    (64, torch.float16, True),
    (128, torch.float16, False),
    (64, torch.float32, True),
    (128, torch.float32, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dim,dtype,causal", GPU_CASES)
def test_gpu_matches_reference(dim, dtype, causal):
    q, k, v = make_qkv(2, 4, 2, 1031, 1031, dim, dtype, "cuda")
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=causal), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [128, 256])
def test_gpu_softcap_matches_reference(dim):
    """Gemma 2's softcapped scores (its head dim 256) under a window shorter than the rows, in bf16;
    a cap of 1 bends every score the random inputs give."""
    q, k, v = make_qkv(2, 4, 2, 1031, 1031, dim, torch.bfloat16, "cuda")
    run = lambda *a: fastlm.flash_attention(*a, causal=True, window=(300, 0), softcap=1.0)  # noqa: E731
    check_attention(run, q, k, v, True, window=(300, 0), softcap=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("nq,nk", [(2048, 2048), (4096, 4096), (1, 3000), (3000, 1), (777, 2500), (2500, 777)])
def test_gpu_lengths(nq, nk):
    q, k, v = make_qkv(1, 2, 1, nq, nk, 128, torch.bfloat16, "cuda")
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=True), q, k, v, True)


# (Nq, Nk, causal, window, head dim): a window across many 128-key tiles, a two-sided band, Nq != Nk
# both ways (rows without keys, the diagonal off the tile grid), the diagonal alone, and a window
# wider than the sequence.
GPU_WINDOWS = [
    (4096, 4096, True, (1024, -1), 128),
    (4096, 4096, False, (256, 256), 64),
    (3000, 4100, False, (100, 0), 128),
    (4100, 3000, True, (777, -1), 64),
    (2048, 2048, True, (0, -1), 128),
    (2048, 2048, False, (5000, 5000), 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("nq,nk,causal,window,dim", GPU_WINDOWS)
def test_gpu_window(nq, nk, causal, window, dim):
    q, k, v = make_qkv(1, 4, 2, nq, nk, dim, torch.bfloat16, "cuda")
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=causal, window=window), q, k, v, causal, window=window)


@pytest.mark.gpu
def test_gpu_window_cost_grows_linearly():
    """A causal window of 512 keys: from 8k to 16k tokens the forward+backward time about doubles
    (quadratic cost would quadruple it), and at 16k it is a small fraction of full causal attention
    (512 of 8192 keys per query on average: 1/16, plus the partly masked tiles)."""

    def step_ms(n, window):
        q, k, v = make_qkv(1, 16, 16, n, n, 128, torch.bfloat16, "cuda")
        grad_out = torch.randn_like(q)
        attend = lambda: fastlm.flash_attention(q, k, v, causal=True, window=window).backward(grad_out)
        return triton.testing.do_bench(attend, grad_to_none=[q, k, v])

    windowed = step_ms(16384, (512, -1))
    assert windowed < 2.6 * step_ms(8192, (512, -1))
    assert windowed < 0.2 * step_ms(16384, None)


@pytest.mark.gpu
def test_gpu_compiled_layers_copy_nothing():
    """Two compiled attention layers on token-major views generate no Inductor kernel at all: every
    launch writes fresh buffers of its own. (Merged allocations, or a stand-in pointer counted as
    written, would each put a full copy before a launch.)"""
    from torch._inductor.utils import run_and_get_code

    def leaf():  # (B, N, H, D), handed to attention as a (B, H, N, D) view
        return torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k1, v1, k2, v2, grad = (leaf() for _ in range(6))

    def layers(q, k1, v1, k2, v2):
        first = fastlm.flash_attention(*(t.transpose(1, 2) for t in (q, k1, v1)), causal=True)
        return fastlm.flash_attention(first, k2.transpose(1, 2), v2.transpose(1, 2), causal=True).transpose(1, 2)

    torch._dynamo.reset()
    compiled = torch.compile(layers, fullgraph=True)
    _, code = run_and_get_code(lambda: compiled(q, k1, v1, k2, v2).backward(grad))
    generated = re.findall(r"async_compile\.triton\('(triton_\w+)'", "\n".join(code))
    assert not generated, f"Inductor added kernels around the launches: {generated}"
    assert all(t.grad is not None for t in (q, k1, v1, k2, v2))


@pytest.mark.gpu
def test_gpu_backward_bit_identical():
    q, k, v = make_qkv(2, 8, 2, 4096, 4096, 128, torch.bfloat16, "cuda")
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    runs = [torch.autograd.grad(fastlm.flash_attention(q, k, v, causal=True), (q, k, v), grad_out) for _ in range(3)]
    assert all(torch.equal(a, b) for later in runs[1:] for a, b in zip(runs[0], later, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128])  # 128: the forward through descriptors, whose scratch Inductor allocates
@pytest.mark.parametrize("heads", [4, 0], ids=["4d-gqa2", "3d"])  # 0: 3-D inputs
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])  # aot_eager: fastlm's launcher runs the traced op
def test_gpu_eager_launch_matches_compiled(heads, dim, backend):
    """The eager path (eager_kernel launches) and the traced one (Inductor, or fastlm's launcher
    under aot_eager, launches the same kernels with the same tiles) give the same output and
    gradients, bit for bit."""
    q, k, v = make_qkv(2, max(heads, 1), max(heads // 2, 1), 131, 131, dim, torch.bfloat16, "cuda")
    if not heads:
        q, k, v = (t.detach()[:, 0].requires_grad_(True) for t in (q, k, v))
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def attend(q, k, v):
        return fastlm.flash_attention(q, k, v, causal=True)

    torch._dynamo.reset()
    runs = []
    for fn in (attend, torch.compile(attend, fullgraph=True, backend=backend)):
        out = fn(q, k, v)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, eager, compiled in zip(("out", "dq", "dk", "dv"), *runs, strict=True):
        assert torch.equal(eager, compiled), name


@pytest.mark.gpu
def test_gpu_direct_launch_matches_triton_dispatch(monkeypatch):
    """The direct launches give Triton's dispatcher's bits, here on inputs that are neither 16-byte
    aligned (one element in) nor unit-strided but in D ((B, N, H, D+1) memory)."""

    def odd_layout(heads, length):
        memory = torch.randn(2 * length * heads * 65 + 1, device="cuda", dtype=torch.bfloat16)[1:]
        return memory.view(2, length, heads, 65)[..., :64].transpose(1, 2).requires_grad_(True)

    q, k, v = odd_layout(4, 150), odd_layout(2, 150), odd_layout(2, 150)
    assert q.data_ptr() % 16 and q.stride() == (150 * 4 * 65, 65, 4 * 65, 1)
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def forward_and_grads():
        out = fastlm.flash_attention(q, k, v, causal=True)
        return out, *torch.autograd.grad(out, (q, k, v), grad_out)

    kernels = (_flash_forward_kernel, _flash_backward_dq_kernel, _flash_backward_dkdv_kernel)
    assert_direct_launch_matches_dispatcher(forward_and_grads, kernels, monkeypatch)
    check_attention(lambda *a: fastlm.flash_attention(*a, causal=True), q, k, v, True)
