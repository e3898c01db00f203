"""fastlm.cross_entropy against the float64 reference: losses and gradients, every path.

On CPU the kernels run through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so
shapes stay small; the `gpu` tests repeat the checks at real sizes with tight tolerances.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.layers import CrossEntropyLoss
from fastlm.ops import cross_entropy as ce
from fastlm.ops.common import cdiv, device_arch, multiprocessors
from fastlm.ops.cross_entropy import (
    DEFAULT_CONFIG,
    CrossEntropyFunction,
    CrossEntropyFusedFunction,
    cross_entropy_backward,
    cross_entropy_config,
    cross_entropy_forward,
    cross_entropy_ref,
)

from .launches import compiled_code_launches
from .reference import check_against_float64, check_results_against_float64, unit_roundoff

# Shapes: 1 class and 1 row (degenerate), a prime vocab (masking inside one block), a vocab just
# above the 8192-wide block (a second, almost empty block), and a wide-ish batch of small rows.
SHAPES = [(1, 1), (3, 37), (2, 8193), (17, 128)]

# (loss, gradient, fused path's gradient): how far fastlm's normwise error may pass that of
# cross_entropy_ref (float64: the truth). The losses are fp32 in every dtype, accumulated in fp32
# from the given logits, as the reference's: 1e-6 (sums in other orders). The gradient is written
# in the logits' dtype: in 16-bit an eighth of the unit roundoff, as both compute it in fp32 and
# round it once, at different points. The fused path rounds its 16-bit gradient in the forward and
# again when the backward scales it by an upstream gradient other than 1 (docs/cross_entropy.md):
# a whole unit roundoff.
ALLOWANCE = {
    torch.float32: (1e-6, 1e-6, 1e-6),
    torch.float16: (1e-6, unit_roundoff(torch.float16) / 8, unit_roundoff(torch.float16)),
    torch.bfloat16: (1e-6, unit_roundoff(torch.bfloat16) / 8, unit_roundoff(torch.bfloat16)),
}

PATHS = [  # (fused, inplace)
    pytest.param(False, False, id="recompute"),
    pytest.param(True, False, id="fused"),
    pytest.param(True, True, id="fused-inplace"),
]


def make_inputs(batch, vocab, dtype, device, ignore_fraction=0.25, scale=4.0):
    """Random logits (not zeros: they would hide unwritten outputs) and targets with some ignored."""
    logits = (torch.randn(batch, vocab, device=device) * scale).to(dtype)
    targets = torch.randint(0, vocab, (batch,), device=device)
    ignored = torch.rand(batch, device=device) < ignore_fraction
    targets[ignored] = -100
    return logits, targets


def run_fastlm(logits, targets, upstream, fused, inplace, **options):
    """Loss and d(loss * upstream)/dlogits through fastlm; logits pass through a non-leaf op
    (as the LM head's output would) so that the in-place path is allowed."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss = fastlm.cross_entropy(leaf * 1, targets, fused=fused, inplace=inplace, **options)
    loss.backward(upstream)
    return loss.detach(), leaf.grad


def check(logits, targets, fused, inplace=False, run=None, **options):
    """Loss and gradient through fastlm (``run(logits)`` when given, else fastlm.cross_entropy on
    the path ``fused`` / ``inplace``) against cross_entropy_ref, by `check_against_float64`: for a
    random upstream gradient, so that the scaling of saved gradients is checked too. The in-place
    path takes the logits through a non-leaf op, as the LM head's output would be."""
    if run is None:
        run = lambda x: fastlm.cross_entropy(x * 1 if inplace else x, targets, fused=fused, inplace=inplace, **options)
    loss_allowance, grad_allowance, fused_grad_allowance = ALLOWANCE[logits.dtype]
    loss = check_against_float64(
        run,
        lambda x: cross_entropy_ref(x, targets, **options),
        [logits.detach().requires_grad_(True)],
        loss_allowance,
        fused_grad_allowance if fused else grad_allowance,
    )
    assert loss.dtype == torch.float32


def check_standalone(losses, grad, logits, targets, grad_output):
    """cross_entropy_forward's losses and cross_entropy_backward's gradient (for ``grad_output``)
    against cross_entropy_ref, by `check_results_against_float64`."""
    assert losses.dtype == torch.float32 and grad.dtype == logits.dtype
    leaf = logits.detach().requires_grad_(True)
    check_results_against_float64(
        [losses, grad],
        lambda x: cross_entropy_ref(x, targets, reduction="none"),
        [leaf],
        grad_output,
        *ALLOWANCE[logits.dtype][:2],
    )


# Every path at every shape in fp32 and in a 16-bit dtype, with per-row upstream gradients
# (reduction "none", the fused path's row scale); the reductions that scale every row alike, and
# fp16, at the shape of many rows (a mean over its valid ones), on every path.
GRID = [(shape, dtype, "none") for shape in SHAPES for dtype in (torch.float32, torch.bfloat16)] + [
    ((17, 128), dtype, reduction)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for reduction in ("mean", "sum", "none")
    if (dtype, reduction) not in ((torch.float32, "none"), (torch.bfloat16, "none"))
]


@pytest.mark.parametrize("fused,inplace", PATHS)
@pytest.mark.parametrize("shape,dtype,reduction", GRID, ids=[f"{b}x{v}-{str(d)[6:]}-{r}" for (b, v), d, r in GRID])
def test_matches_reference(shape, dtype, reduction, fused, inplace, device):
    batch, vocab = shape
    logits, targets = make_inputs(batch, vocab, dtype, device)
    targets[0] = 0  # at least one valid row, so the mean is finite
    check(logits, targets, fused, inplace, reduction=reduction)


@pytest.mark.parametrize("fused,inplace", PATHS)
@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.1),
        dict(z_loss=1e-2),
        dict(label_smoothing=0.2, z_loss=1e-3, reduction="sum"),
        dict(label_smoothing=1.0, reduction="none"),
        dict(ignore_index=3),  # an ignore_index inside [0, V) wins over being a valid class
    ],
)
def test_options_match_reference(options, fused, inplace, device):
    logits, targets = make_inputs(6, 301, torch.float32, device)
    targets[:2] = 3
    targets[targets == -100] = options.get("ignore_index", -100)
    check(logits, targets, fused, inplace, **options)


def test_reference_matches_torch_semantics():
    """The reference itself: torch's cross-entropy plus z-loss, so the oracle is not circular."""
    logits, targets = make_inputs(9, 50, torch.float64, "cpu")
    targets[0] = 1
    for smoothing in (0.0, 0.3):
        expected = F.cross_entropy(logits, targets, label_smoothing=smoothing)
        assert torch.allclose(cross_entropy_ref(logits, targets, label_smoothing=smoothing), expected)
    valid = targets != -100
    z_term = 1e-2 * (torch.logsumexp(logits, -1)[valid] ** 2).mean()
    got = cross_entropy_ref(logits, targets, z_loss=1e-2)
    assert torch.allclose(got, F.cross_entropy(logits, targets) + z_term)


@pytest.mark.parametrize("fused,inplace", PATHS)
def test_non_contiguous_rows_and_columns(fused, inplace, device):
    wide = torch.randn(5, 400, device=device) * 3
    targets = torch.randint(0, 131, (5,), device=device)
    padded_rows = wide[:, 7:138]  # row stride 400 != V = 131
    transposed = wide[:, :131].t().contiguous().t()  # column stride 5
    for logits in (padded_rows, transposed):
        check(logits, targets, fused, inplace)


@pytest.mark.parametrize("fused,inplace", PATHS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_follows_torch(reduction, fused, inplace, device):
    logits = torch.randn(4, 33, device=device)
    targets = torch.full((4,), -100, device=device)
    loss, grad = run_fastlm(
        logits,
        targets,
        torch.ones(() if reduction != "none" else (4,), device=device),
        fused,
        inplace,
        reduction=reduction,
    )
    expected = F.cross_entropy(logits, targets, reduction=reduction)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0, equal_nan=True)  # mean: NaN (0/0), sum: 0, none: zeros
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_follows_torch(reduction, device):
    logits = torch.randn(0, 10, device=device, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long, device=device)
    loss = fastlm.cross_entropy(logits, targets, reduction=reduction)
    expected = F.cross_entropy(logits.detach(), targets, reduction=reduction)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0, equal_nan=True)
    if reduction != "none":
        loss.backward()
        assert logits.grad.shape == (0, 10)


def test_inputs_far_from_zero_and_minus_inf(device):
    """Large offsets test the online max; -inf entries (masked vocabulary) must not give NaN."""
    logits = torch.randn(3, 5000, device=device) + 1000.0
    logits[:, ::3] = -float("inf")
    targets = torch.tensor([1, 4999, 2], device=device)  # 4999 and 2 are finite entries
    for fused in (False, True):
        check(logits, targets, fused, False)  # a NaN would fail the normwise error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_standalone_forward_and_backward(dtype, device, poisoned_outputs):
    """The two user-loop functions, each output written (poisoned buffers), against float64."""
    logits, _ = make_inputs(7, 1031, dtype, device, ignore_fraction=0.0)
    targets = torch.randint(0, 1031, (7,), device=device)
    grad_output = torch.randn(7, device=device)
    losses = cross_entropy_forward(logits, targets)
    grad = cross_entropy_backward(logits, targets, grad_output)
    check_standalone(losses, grad, logits, targets, grad_output)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Outputs allocated while the test runs start as NaN, so unwritten elements fail."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.mark.parametrize("fused", [False, True])
def test_every_output_written(fused, device, poisoned_outputs):
    logits, targets = make_inputs(5, 2500, torch.float32, device)
    loss, grad = run_fastlm(logits, targets, torch.randn(5, device=device), fused, False, reduction="none")
    assert not loss.isnan().any() and not grad.isnan().any()


def test_reference_path_without_interpreter(monkeypatch):
    """CPU without TRITON_INTERPRET takes the plain-PyTorch path: same values, same API."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, targets = make_inputs(6, 77, torch.float32, "cpu")
    targets[0] = 5
    for fused, inplace in ((False, False), (True, False), (True, True)):
        check(logits, targets, fused, inplace, label_smoothing=0.1, z_loss=1e-3)


def test_inplace_overwrites_logits_and_guards_saved_uses(device):
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    targets = torch.randint(0, 50, (4,), device=device)
    head = logits * 2  # non-leaf, nothing saved it
    fastlm.cross_entropy(head, targets, inplace=True).backward()
    expected = torch.autograd.grad(F.cross_entropy(logits * 2, targets), logits)[0]
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=1e-5)

    squared_input = logits * 1
    saved_by_pow = squared_input**2  # pow saves its input for backward
    loss = fastlm.cross_entropy(squared_input, targets, inplace=True) + saved_by_pow.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_second_backward_is_a_clear_error(inplace, device):
    logits = torch.randn(3, 20, device=device, requires_grad=True)
    loss = fastlm.cross_entropy(logits * 1, torch.tensor([1, 2, 3], device=device), inplace=inplace)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can run only once per forward"):
        loss.backward()


def test_module_passes_every_flag(device):
    logits, targets = make_inputs(6, 40, torch.float32, device)
    targets[targets == -100] = 2
    targets[0] = 2
    module = CrossEntropyLoss(ignore_index=2, reduction="sum", label_smoothing=0.1, z_loss=1e-3, fused=False)
    expected = cross_entropy_ref(logits, targets, ignore_index=2, reduction="sum", label_smoothing=0.1, z_loss=1e-3)
    torch.testing.assert_close(module(logits, targets), expected, atol=1e-5, rtol=1e-5)
    assert "z_loss=0.001" in repr(module)


def test_registered_ops_pass_opcheck(device):
    logits, targets = make_inputs(3, 70, torch.float32, device)
    logits.requires_grad_(True)
    torch.library.opcheck(torch.ops.fastlm.cross_entropy_forward, (logits, targets, -100, 0.1, 1e-3))
    losses, stats = torch.ops.fastlm.cross_entropy_forward(logits.detach(), targets, -100, 0.1, 1e-3)
    upstream = torch.randn(3, device=device)
    backward_args = (logits.detach(), targets, stats, upstream, -100, 0.1, 1e-3)  # no double backward
    torch.library.opcheck(torch.ops.fastlm.cross_entropy_backward, backward_args)
    # The fused op's backward scales its saved gradient in place (that is what makes it free), which
    # opcheck's AOT check of the op alone rejects; test_torch_compile_fullgraph covers compile.
    fused_utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for row_scale, mean in ((None, True), (None, False), (upstream, False)):
        torch.library.opcheck(
            torch.ops.fastlm.cross_entropy_fused,
            (logits, targets, row_scale, -100, 0.0, 0.0, mean),
            test_utils=fused_utils,
        )
    grad = torch.randn(3, 70, device=device)
    torch.library.opcheck(torch.ops.fastlm.cross_entropy_scale_rows_, (grad, upstream))


# each op once, the fused one (what training runs) under dynamic shapes: an Inductor compile costs
# seconds on a CPU, and the other two pairs trace the same ops
@pytest.mark.parametrize(("fused", "dynamic"), [(False, False), (True, True)], ids=["unfused-static", "fused-dynamic"])
def test_torch_compile_fullgraph(fused, dynamic, device):
    logits, targets = make_inputs(4, 96, torch.float32, device)
    weight = torch.randn(96, 96, device=device, requires_grad=True)

    def step(x):
        return fastlm.cross_entropy(x @ weight, targets, fused=fused, label_smoothing=0.1)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    loss = compiled(logits)
    (grad,) = torch.autograd.grad(loss, weight)
    ref = cross_entropy_ref(logits @ weight, targets, label_smoothing=0.1)
    (ref_grad,) = torch.autograd.grad(ref, weight)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-4)


def test_compiled_user_loop_functions(device):
    """cross_entropy_forward / _backward trace into the ops under torch.compile (no graph break)."""
    logits, targets = make_inputs(5, 61, torch.float32, device, ignore_fraction=0.0)
    grad_output = torch.randn(5, device=device)
    compiled = torch.compile(
        lambda x, t, g: (cross_entropy_forward(x, t), cross_entropy_backward(x, t, g)),
        fullgraph=True,
        backend="aot_eager",
    )
    losses, grad = compiled(logits, targets, grad_output)
    check_standalone(losses, grad, logits, targets, grad_output)


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_cpu_rejects_out_of_range_targets(fused):
    """Compiled, the ops check no target range (a trace cannot read values); on CPU the traced
    reference path (torch's cross-entropy, compiled by Inductor) rejects the target itself."""
    logits = torch.randn(4, 10, requires_grad=True)
    targets = torch.tensor([0, 10, -100, 2])
    compiled = torch.compile(lambda x, t: fastlm.cross_entropy(x * 1, t, fused=fused), fullgraph=True)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        compiled(logits, targets)


# Blocks far narrower than the rows, so every loop runs several steps at interpreter-sized shapes:
# the forward's online softmax, the backward's column blocks, both passes of the fused kernel.
NARROW_BLOCKS = dict(forward_block=16, backward_block=32, fused_block=16, forward_warps=1, fused_warps=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_explicit_config(dtype, device):
    logits, targets = make_inputs(5, 83, dtype, device)
    targets[0] = 4
    config = dataclasses.replace(cross_entropy_config(device_arch(logits.device), dtype, 83), **NARROW_BLOCKS)
    check(
        logits,
        targets,
        False,
        run=lambda x: CrossEntropyFunction.apply(x, targets, -100, 0.0, 1e-3, config),
        reduction="none",
        z_loss=1e-3,
    )
    # scale-rows with factors other than 1, in column blocks
    fused = lambda x: CrossEntropyFusedFunction.apply(x, targets, -100, 0.0, 1e-3, "none", False, config)
    check(logits, targets, True, run=fused, reduction="none", z_loss=1e-3)


def test_config_pick():
    """A table entry for the H100 / H200, a default (never an error) elsewhere; blocks no wider than
    the row needs; cached."""
    for arch in (90, 80, 0):
        config = cross_entropy_config(arch, torch.bfloat16, 128256)
        assert config == DEFAULT_CONFIG
        assert cross_entropy_config(arch, torch.bfloat16, 128256) is config
    small = cross_entropy_config(90, torch.float32, 37)
    assert (small.forward_block, small.backward_block, small.fused_block) == (64, 64, 64)
    assert cross_entropy_config(90, torch.float32, 32767).fused_block == DEFAULT_CONFIG.fused_block
    # the fused kernel's blocks pad a row by at most a sixth
    assert [cross_entropy_config(90, torch.bfloat16, v).fused_block for v in (32000, 50264, 128256)] == [
        16384,
        8192,
        16384,
    ]


@pytest.mark.parametrize("count_block", [16, 64])
def test_fused_mean_counts_targets_in_steps(count_block, device):
    """The fused kernel counts a mean's valid rows itself, count_block targets per step: 37 rows
    take three steps of 16 (the last one masked), or one of 64."""
    logits, targets = make_inputs(37, 29, torch.float32, device, ignore_fraction=0.4)
    config = dataclasses.replace(
        cross_entropy_config(device_arch(logits.device), torch.float32, 29), fused_count_block=count_block
    )
    check(
        logits,
        targets,
        True,
        run=lambda x: CrossEntropyFusedFunction.apply(x, targets, -100, 0.0, 0.0, "mean", False, config),
    )


# ---------------------------------------------------------------------------------------------
# GPU: real sizes, tight tolerances, device-only behaviour
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fused,inplace", PATHS)
@pytest.mark.parametrize("vocab", [32000, 50264, 128256, 262144])
def test_gpu_large_vocab_bf16(vocab, fused, inplace):
    logits, targets = make_inputs(64, vocab, torch.bfloat16, "cuda")
    check(logits, targets, fused, inplace, reduction="none", z_loss=1e-4)


@pytest.mark.gpu
def test_gpu_invalid_target_gives_nan_not_oob():
    logits = torch.randn(3, 1000, device="cuda", requires_grad=True)
    targets = torch.tensor([5, 1000, -7], device="cuda")
    losses = fastlm.cross_entropy(logits, targets, reduction="none", fused=False)
    assert losses[0].isfinite() and losses[1:].isnan().all()
    losses.sum().backward()
    assert logits.grad[0].isfinite().all() and logits.grad[1:].isnan().all()


@pytest.mark.gpu
def test_gpu_more_than_2_to_the_31_elements():
    """int64 offsets: rows past element 2**31 must be read and written at the right place."""
    batch, vocab = 16400, 131072  # 2.15e9 elements, 4.3 GB in bf16
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (batch,), device="cuda")
    grad = cross_entropy_backward(logits, targets, torch.ones(batch, device="cuda"))
    losses = cross_entropy_forward(logits, targets)
    tail = slice(batch - 3, batch)
    check_standalone(losses[tail], grad[tail], logits[tail], targets[tail], torch.ones(3, device="cuda"))


@pytest.mark.gpu
def test_gpu_deterministic():
    logits, targets = make_inputs(256, 50264, torch.bfloat16, "cuda")
    first = cross_entropy_backward(logits, targets, torch.ones(256, device="cuda"))
    second = cross_entropy_backward(logits, targets, torch.ones(256, device="cuda"))
    assert torch.equal(first, second)
    assert not math.isnan(float(cross_entropy_forward(logits, targets).sum()))


def _launch_through_triton(logits, targets, upstream, config):
    """Every kernel through Triton's own dispatcher, with the launchers' arguments."""
    batch, vocab = logits.shape
    f32 = dict(device="cuda", dtype=torch.float32)
    flags = dict(HAS_SMOOTHING=True, HAS_Z_LOSS=True)
    losses, stats = torch.empty(batch, **f32), torch.empty(2, batch, **f32)
    ce._cross_entropy_forward_kernel[(batch,)](
        logits,
        *logits.stride(),
        targets,
        targets.stride(0),
        losses,
        stats,
        batch,
        vocab,
        -100,
        0.1,
        1e-3,
        BLOCK_V=config.forward_block,
        num_warps=config.forward_warps,
        **flags,
    )
    grad = torch.empty(batch, vocab, device="cuda", dtype=logits.dtype)
    ce._cross_entropy_backward_kernel[(batch, cdiv(vocab, config.backward_block))](
        logits,
        *logits.stride(),
        targets,
        targets.stride(0),
        stats,
        upstream,
        upstream.stride(0),
        grad,
        batch,
        vocab,
        -100,
        0.1,
        1e-3,
        BLOCK_V=config.backward_block,
        num_warps=config.backward_warps,
        **flags,
    )
    fused_losses, fused_grad = torch.empty(batch, **f32), torch.empty_like(grad)
    programs = min(batch, config.fused_programs_per_sm * multiprocessors(0))
    ce._cross_entropy_fused_kernel[(programs,)](
        logits,
        *logits.stride(),
        targets,
        targets.stride(0),
        fused_losses,
        0,
        fused_losses,
        fused_grad,
        *fused_grad.stride(),
        batch,
        vocab,
        -100,
        0.1,
        1e-3,
        BLOCK_V=config.fused_block,
        HAS_ROW_SCALE=False,
        MEAN=True,
        COUNT_BLOCK=config.fused_count_block,
        num_warps=config.fused_warps,
        **flags,
    )
    scaled = fused_grad.clone()
    ce._scale_rows_kernel[(batch, cdiv(vocab, config.backward_block))](
        scaled,
        *scaled.stride(),
        upstream,
        upstream.stride(0),
        vocab,
        BLOCK_V=config.backward_block,
        num_warps=config.backward_warps,
    )
    return losses, stats, grad, fused_losses, fused_grad, scaled


def _launch_through_launchers(logits, targets, upstream):
    losses, stats = ce._forward(logits, targets, -100, 0.1, 1e-3)
    grad = ce._backward(logits, targets, stats, upstream, -100, 0.1, 1e-3)
    fused_losses, fused_grad = ce._fused(logits, targets, None, -100, 0.1, 1e-3, True)
    scaled = fused_grad.clone()
    ce._scale_rows(scaled, upstream)
    return losses, stats, grad, fused_losses, fused_grad, scaled


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_eager_launch_matches_triton_dispatch(dtype):
    """The launchers' eager_kernel path (first call through Triton, later calls through the cached
    binary) gives the same bits as Triton's dispatcher, on layouts that change Triton's
    specialization: unaligned storage, an odd row stride, a column stride, strided targets."""
    batch, vocab = 37, 4999  # prime vocab: a partial last block in every kernel
    storage = torch.randn(batch * (vocab + 2) + 1, device="cuda").mul(4).to(dtype)
    layouts = {
        "unaligned": storage[1 : 1 + batch * vocab].view(batch, vocab),  # data_ptr 2 or 4 bytes past 16
        "odd row stride": storage[: batch * (vocab + 2)].view(batch, vocab + 2)[:, 1 : 1 + vocab],
        "column stride": storage[: batch * vocab].view(vocab, batch).t(),  # strides (1, 37)
    }
    all_targets = torch.randint(0, vocab, (2 * batch,), device="cuda")
    all_targets[::5] = -100
    upstream = torch.randn(3 * batch, device="cuda")[::3]  # stride 3
    for name, logits in layouts.items():
        for targets in (all_targets[:batch], all_targets[::2].int()):  # contiguous int64, strided int32
            config = cross_entropy_config(90, dtype, vocab)
            expected = _launch_through_triton(logits, targets, upstream, config)
            for call in ("first", "cached"):
                got = _launch_through_launchers(logits, targets, upstream)
                for what, a, b in zip(
                    ("losses", "stats", "grad", "fused losses", "fused grad", "scaled"), got, expected, strict=True
                ):
                    assert torch.equal(a, b), f"{name}, {targets.dtype}, {call} call: {what} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_inductor_launches_the_kernels_from_its_code(fused):
    logits, targets = make_inputs(64, 5000, torch.bfloat16, "cuda")
    targets[0] = 3
    logits.requires_grad_(True)
    kernels = (
        ("_cross_entropy_fused_kernel", "_scale_rows_kernel")
        if fused
        else ("_cross_entropy_forward_kernel", "_cross_entropy_backward_kernel")
    )
    ops = ("fastlm.cross_entropy_fused", "fastlm.cross_entropy_scale_rows_", "fastlm.cross_entropy_forward")

    def loss(x):
        return fastlm.cross_entropy(x * 1, targets, fused=fused, z_loss=1e-4)

    compiled_code_launches(loss, (logits,), kernels, ops)
    check(logits, targets, fused, run=torch.compile(loss, fullgraph=True), z_loss=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_compiles_with_dynamic_shapes(fused):
    """Sizes are SymInts inside the traced launchers: the config is picked uncached, and the
    blocks of a vocabulary wider than the widest block do not specialize on it."""
    compiled = torch.compile(lambda x, t: fastlm.cross_entropy(x * 1, t, fused=fused), fullgraph=True, dynamic=True)
    for batch, vocab in ((64, 9000), (100, 9001), (7, 50)):
        logits, targets = make_inputs(batch, vocab, torch.float32, "cuda")
        targets[0] = 1
        check(logits, targets, fused, run=lambda x: compiled(x, targets))  # noqa: B023 (called at once)
