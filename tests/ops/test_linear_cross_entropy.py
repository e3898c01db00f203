"""fastlm.linear_cross_entropy against the float64 reference: losses and every gradient, all paths.

On CPU the cross-entropy kernels run through the Triton interpreter (conftest sets
TRITON_INTERPRET=1) and cost about 10 ms per row, so shapes stay small; the `gpu` tests repeat the
checks at real sizes and check what only a GPU has (cuBLAS's fp32 accumulation, Inductor's code,
the memory the chunks save).
"""

import re

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.layers import LinearCrossEntropyLoss
from fastlm.ops import linear_cross_entropy as lce
from fastlm.ops.linear_cross_entropy import (
    CHUNK_ROW_MULTIPLE,
    linear_cross_entropy_config,
    linear_cross_entropy_ref,
)

from .launches import compiled_code_launches
from .reference import check_against_float64, check_results_against_float64, gradients, unit_roundoff
from .test_cross_entropy import poisoned_outputs  # noqa: F401 (a fixture)

# 21 tokens: chunks of 8 leave a partial last chunk of 5; width 29 (prime); vocabulary 131: prime,
# just above the 128 of a power-of-two tile, so the kernels' last block is mostly masked.
N, D, V = 21, 29, 131
REDUCTIONS = ("mean", "sum", "none")

# How far fastlm's normwise error may pass that of linear_cross_entropy_ref (float64: the truth).
# fp32: matmuls and sums in other orders (the chunks'), loss and gradients alike.
FP32_ALLOWANCE = 1e-6
# bf16 matmuls (bf16 inputs, or autocast), against the reference under autocast: (loss, gradients).
# Both round the logits to bf16 and compute the losses from them in fp32, and round dlogits and the
# matmuls' outputs to bf16: an eighth of the unit roundoff for roundings at different points. A
# bf16 weight's gradient is summed over the chunks in bf16, rounded once per chunk where torch's
# one matmul rounds once (docs/cross_entropy.md): a quarter.
BF16_ALLOWANCE = (unit_roundoff(torch.bfloat16) / 8, unit_roundoff(torch.bfloat16) / 4)


def make_inputs(dtype=torch.float32, bias=True, rows=N, device="cpu", ignore_fraction=0.25):
    """hidden (rows, D), weight (V, D), bias (V,) or None, targets (rows,) with some ignored rows,
    the first one valid (a finite mean). Logits of std ~3: a peaked softmax, not a uniform one."""
    hidden = torch.randn(rows, D, device=device).to(dtype)
    weight = (torch.randn(V, D, device=device) * 3 / D**0.5).to(dtype)
    bias_ = torch.randn(V, device=device).to(dtype) if bias else None
    targets = torch.randint(0, V, (rows,), device=device)
    targets[torch.rand(rows, device=device) < ignore_fraction] = -100
    targets[:1] = 1
    return hidden, weight, bias_, targets


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def check_fp32(hidden, weight, bias, targets, chunk_rows=8, trainable=("hidden", "weight", "bias"), **options):
    """Loss and the gradients of the ``trainable`` ones of hidden, weight and bias, for a random
    upstream gradient (so the scaling of a mean's or sum's saved gradients is checked too), against
    the reference, by `check_against_float64`."""
    inputs = leaves(hidden, weight, bias)
    for name, tensor in zip(("hidden", "weight", "bias"), inputs, strict=True):
        if tensor is not None:
            tensor.requires_grad_(name in trainable)
    check_against_float64(
        lambda h, w, b: fastlm.linear_cross_entropy(h, w, targets, b, chunk_rows=chunk_rows, **options),
        lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b, **options),
        inputs,
        FP32_ALLOWANCE,
    )


def under_bf16_autocast(function):
    """``function`` under bf16 autocast, as a model's LM head runs (float64 is never cast)."""

    def run(*inputs):
        with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16):
            return function(*inputs)

    return run


def bf16_results(hidden, weight, bias, targets, upstream, autocast=False, **options):
    """fastlm's [loss, gradients of hidden, weight and bias] from bf16 matmuls (bf16 inputs, or
    ``autocast``), checked against the reference's own bf16 path (the reference under autocast),
    by `check_results_against_float64`; returned for the test's own checks."""
    inputs = leaves(hidden, weight, bias)
    run = lambda h, w, b: fastlm.linear_cross_entropy(h, w, targets, b, **options)
    loss = (under_bf16_autocast(run) if autocast else run)(*inputs)
    results = [loss, *gradients(loss, inputs, upstream)]
    options.pop("chunk_rows", None)
    reference = under_bf16_autocast(lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b, **options))
    check_results_against_float64(results, reference, inputs, upstream, *BF16_ALLOWANCE)
    assert loss.dtype == torch.float32
    return results


@pytest.mark.parametrize("chunk_rows", [8, None])  # three chunks, the last partial; one chunk (config)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_reference(reduction, bias, chunk_rows, device):
    hidden, weight, bias_, targets = make_inputs(bias=bias, device=device)
    check_fp32(hidden, weight, bias_, targets, chunk_rows, reduction=reduction)


@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.1),
        dict(z_loss=1e-2),
        dict(softcap=2.0),  # below the logits' spread: tanh saturates for many of them
        dict(ignore_index=3),  # an ignore_index inside [0, V) wins over being a valid class
        dict(label_smoothing=0.2, z_loss=1e-3, softcap=5.0, reduction="none"),  # recomputed in backward
        dict(label_smoothing=1.0, softcap=5.0, reduction="sum"),
    ],
)
def test_options_match_reference(options, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    targets[targets == -100] = options.get("ignore_index", -100)
    targets[1:3] = 3
    check_fp32(hidden, weight, bias, targets, **options)


@pytest.mark.parametrize("chunk_rows", [1, 20, 64])  # a row per chunk; 20 + 1; one chunk larger than N
def test_chunk_sizes(chunk_rows, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    check_fp32(hidden, weight, bias, targets, chunk_rows, z_loss=1e-3)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bf16_matches_reference(reduction, device):
    hidden, weight, bias, targets = make_inputs(torch.bfloat16, device=device)
    upstream = torch.rand((N,) if reduction == "none" else (), device=device) + 0.5
    bf16_results(hidden, weight, bias, targets, upstream, reduction=reduction, softcap=5.0, chunk_rows=8)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_autocast_with_fp32_weight(hidden_dtype, device):
    """A model's fp32 master weight under bf16 autocast: bf16 matmuls, and the weight and bias
    gradients accumulated over the chunks in fp32 buffers returned as they are."""
    hidden, weight, bias, targets = make_inputs(device=device)
    hidden = hidden.to(hidden_dtype)
    _, _, grad_weight, _ = bf16_results(
        hidden, weight, bias, targets, torch.tensor(1.0, device=device), autocast=True, chunk_rows=8
    )
    assert not torch.equal(grad_weight, grad_weight.bfloat16().float()), "weight gradient rounded to bf16"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_path_without_interpreter(reduction, monkeypatch):
    """CPU without TRITON_INTERPRET: the cross-entropy launchers' plain-PyTorch path, same values."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, bias, targets = make_inputs()
    check_fp32(hidden, weight, bias, targets, reduction=reduction, softcap=5.0, label_smoothing=0.1, z_loss=1e-3)


def test_outside_autocast_dtypes_must_match():
    hidden, weight, _, targets = make_inputs()
    with pytest.raises(TypeError, match="must share one dtype outside torch.autocast"):
        fastlm.linear_cross_entropy(hidden.bfloat16(), weight, targets)


def test_without_grad_runs_forward_only(monkeypatch, device):
    hidden, weight, bias, targets = make_inputs(device=device)

    def no_gradients(*args, **kwargs):
        raise AssertionError("computed gradients nobody asked for")

    monkeypatch.setattr(lce, "_chunked_gradients", no_gradients)

    def under_no_grad(h, w, b):  # on inputs that require grad
        with torch.no_grad():
            return fastlm.linear_cross_entropy(*leaves(h, w), targets, b, chunk_rows=8)

    reference = lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b)
    loss = check_against_float64(under_no_grad, reference, (hidden, weight, bias), FP32_ALLOWANCE)
    assert loss.grad_fn is None
    nothing_requires_grad = lambda h, w, b: fastlm.linear_cross_entropy(h, w, targets, b, chunk_rows=8)
    check_against_float64(nothing_requires_grad, reference, (hidden, weight, bias), FP32_ALLOWANCE)


@pytest.mark.parametrize(
    "trainable,reduction",
    [(("hidden",), "mean"), (("weight", "bias"), "none")],  # a frozen LM head; a frozen trunk
)
def test_gradients_only_where_required(trainable, reduction, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    check_fp32(hidden, weight, bias, targets, trainable=trainable, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_follows_torch(reduction, device):
    hidden, weight, bias = leaves(*make_inputs(rows=0, device=device)[:3])
    targets = torch.zeros(0, dtype=torch.long, device=device)
    loss = fastlm.linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction)
    expected = F.cross_entropy(F.linear(hidden, weight, bias).detach(), targets, reduction=reduction)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0, equal_nan=True)  # mean: NaN; sum: 0
    loss.sum().backward()
    assert hidden.grad.shape == (0, D)
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored_follows_torch(reduction, device):
    hidden, weight, bias, _ = make_inputs(device=device)
    targets = torch.full((N,), -100, device=device)
    inputs = leaves(hidden, weight, bias)
    loss = fastlm.linear_cross_entropy(inputs[0], inputs[1], targets, inputs[2], reduction=reduction, chunk_rows=8)
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction=reduction)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0, equal_nan=True)  # NaN, 0, zeros
    loss.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in inputs)  # zeros, not NaN


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_output_written(reduction, device):
    """Buffers start as NaN: the chunks write every loss and every row of grad_hidden, and the first
    chunk's weight-gradient matmul ignores the buffer's old contents."""
    inputs = leaves(*make_inputs(device=device)[:3])
    targets = make_inputs(device=device)[3]
    loss = fastlm.linear_cross_entropy(inputs[0], inputs[1], targets, inputs[2], reduction=reduction, chunk_rows=8)
    loss.sum().backward()
    assert not loss.isnan().any() and not any(t.grad.isnan().any() for t in inputs)


def test_second_backward_is_a_clear_error(device):
    hidden, weight, _, targets = make_inputs(bias=False, device=device)
    loss = fastlm.linear_cross_entropy(*leaves(hidden, weight), targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="can run only once per forward"):
        loss.backward()


@pytest.mark.parametrize(
    "reduction,backend",
    # Inductor once (a minute on CPU); the backward op traced too
    [pytest.param("mean", "inductor", marks=pytest.mark.slow), ("none", "aot_eager")],
)
def test_torch_compile_matches_eager(reduction, backend, device):
    """Compiled, the ops trace into the matmuls and the cross-entropy launchers (on CPU their
    reference path, as the interpreter cannot run on a trace's fake tensors)."""
    hidden, weight, bias, targets = make_inputs(device=device)
    options = dict(reduction=reduction, softcap=5.0, z_loss=1e-3, chunk_rows=8)

    def loss_and_grads(fn):
        inputs = leaves(hidden, weight, bias)
        loss = fn(*inputs)
        loss.sum().backward()
        return [loss.detach(), *(t.grad for t in inputs)]

    def step(h, w, b):
        return fastlm.linear_cross_entropy(h, w, targets, b, **options)

    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(step, fullgraph=True, backend=backend))
    for got, want in zip(compiled, loss_and_grads(step), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])  # 5.0: the capped logits keep the aligned buffer
@pytest.mark.parametrize("bias", [True, False])
def test_traced_logits_rows_are_128_byte_aligned(bias, softcap, monkeypatch, device):
    """The registered op (what torch.compile traces) computes each chunk's logits with a row stride
    of a multiple of 128 bytes (V = 131 in fp32: 160), the stride Inductor gives a matmul's output,
    and hands the fused kernel that whole buffer with the vocabulary's size, not a view of its
    first V columns (Inductor clones a view a user kernel writes before the launch): no copy on
    either count. Losses and gradients equal the eager path's."""
    launches = []

    def spy(logits, *args, **kwargs):
        written = args[6]  # the gradient's buffer: the logits' own, whole (no view: Inductor would clone it)
        assert written is logits
        launches.append((tuple(logits.shape), logits.stride(0), logits._base is None, kwargs["vocab"]))
        return fused(logits, *args, **kwargs)

    fused = lce._fused
    monkeypatch.setattr(lce, "_fused", spy)
    hidden, weight, bias, targets = make_inputs(bias=bias, device=device)
    options = lce.LossOptions(-100, 0.1, 1e-3, softcap)
    needs = (True, True, bias is not None)
    losses, *eager = lce._chunked_gradients(hidden, weight, bias, targets, None, needs, options, 8)
    chunks = (8, 8, N - 16)
    assert launches == [((rows, V), V, True, V) for rows in chunks]
    launches.clear()
    traced = torch.ops.fastlm.linear_cross_entropy_gradients(hidden, weight, targets, bias, None, *needs, *options, 8)
    assert launches == [((rows, 160), 160, True, V) for rows in chunks]
    torch.testing.assert_close(traced[0], losses.sum(), rtol=1e-6, atol=1e-6)
    for got, want in zip(traced[1:], eager, strict=True):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_registered_ops_pass_opcheck(device):
    """Schema, fake-tensor and autograd registration of the two ops torch.compile traces (9 rows in
    chunks of 4: opcheck runs each op several times)."""
    hidden, weight, bias, targets = (t[:9] if t.shape[0] == N else t for t in make_inputs(device=device))
    hidden, weight, bias = leaves(hidden, weight, bias)
    torch.library.opcheck(
        torch.ops.fastlm.linear_cross_entropy_losses, (hidden, weight, targets, bias, -100, 0.1, 1e-3, 5.0, 4)
    )
    # The gradients op's backward scales the gradients it returned in place (what makes it free when
    # the upstream gradient is 1), which opcheck's AOT check of the op alone rejects, as for the fused
    # cross-entropy op; test_torch_compile_matches_eager covers compile.
    row_scale = torch.rand(9, device=device)
    for args in (
        (hidden, weight, targets, bias, row_scale, True, True, True, -100, 0.0, 0.0, None, 4),
        (hidden, weight, targets, None, None, True, False, False, 3, 0.0, 1e-3, 2.0, None),
    ):
        torch.library.opcheck(
            torch.ops.fastlm.linear_cross_entropy_gradients,
            args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def test_module_passes_every_flag(device):
    hidden, weight, bias, targets = make_inputs(device=device)
    targets[targets == -100] = 2
    options = dict(ignore_index=2, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=4.0)
    module = LinearCrossEntropyLoss(**options, chunk_rows=8)
    check_against_float64(
        lambda h, w, b: module(h, w, targets, b),
        lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b, **options),
        leaves(hidden, weight, bias),
        FP32_ALLOWANCE,
    )
    assert "softcap=4.0, chunk_rows=8" in repr(module)


def test_reference_is_torch_on_the_logits():
    """The reference itself: F.cross_entropy of the materialized (softcapped) logits, so the oracle
    is not circular."""
    hidden, weight, bias, targets = (t if t.dtype == torch.long else t.double() for t in make_inputs())
    logits = hidden @ weight.T + bias
    expected = F.cross_entropy(logits, targets, label_smoothing=0.1)
    torch.testing.assert_close(linear_cross_entropy_ref(hidden, weight, targets, bias, label_smoothing=0.1), expected)
    capped = F.cross_entropy(3.0 * torch.tanh(logits / 3.0), targets, reduction="sum")
    torch.testing.assert_close(
        linear_cross_entropy_ref(hidden, weight, targets, bias, reduction="sum", softcap=3.0), capped
    )


def test_config_pick():
    """Chunks of about 2^29 bytes of logits on the H100 / H200 and 2^28 elsewhere, in multiples of
    128 rows, never fewer than 128; cached."""
    assert linear_cross_entropy_config(90, torch.bfloat16, 128256).chunk_rows == 2048  # 2^29 / (2 V) = 2093
    assert linear_cross_entropy_config(90, torch.bfloat16, 256000).chunk_rows == 1024  # 1048
    assert linear_cross_entropy_config(0, torch.bfloat16, 128256).chunk_rows == 1024  # 1046
    assert linear_cross_entropy_config(90, torch.float32, 32000).chunk_rows == 4096  # 4194
    assert linear_cross_entropy_config(90, torch.float32, 10**7).chunk_rows == CHUNK_ROW_MULTIPLE  # 13
    assert linear_cross_entropy_config(90, torch.bfloat16, 128256) is linear_cross_entropy_config(
        90, torch.bfloat16, 128256
    )


# ---------------------------------------------------------------------------------------------
# GPU: cuBLAS accumulation, real sizes, Inductor's code, memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_matmul_into_accumulates_without_a_temporary(out_dtype):
    """out (+)= a @ b from bf16 operands into out's dtype: the first call overwrites (even NaN), the
    second adds; no buffer of out's size is allocated on the way."""
    a = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)  # dlogits.T: (V, C)
    b = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)  # hidden chunk: (C, d)
    out = torch.empty(4096, 2048, device="cuda", dtype=out_dtype)
    lce._matmul_into(out, a, b, accumulate=False, traced=False)  # cuBLAS's workspace (32 MiB on Hopper) comes first
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lce._matmul_into(out, a, b, accumulate=False, traced=False)
    lce._matmul_into(out, a, b, accumulate=True, traced=False)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < out.numel() * out.element_size() // 4
    expected = 2 * (a.double() @ b.double())
    rtol = 1e-5 if out_dtype == torch.float32 else 8e-3  # fp32 sums; bf16: rounded once per call
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * 32)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_bf16_autocast_matches_reference(reduction):
    """Several chunks of a 32000-class head under bf16 autocast with fp32 weights, the model's case."""
    rows, width, vocab = 1000, 512, 32000
    hidden = torch.randn(rows, width, device="cuda")
    weight = torch.randn(vocab, width, device="cuda") * 3 / width**0.5
    bias = torch.randn(vocab, device="cuda")
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::7] = -100
    upstream = torch.rand((rows,) if reduction == "none" else (), device="cuda") + 0.5
    bf16_results(
        hidden, weight, bias, targets, upstream, autocast=True, reduction=reduction, z_loss=1e-4, chunk_rows=256
    )


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_from_its_code():
    hidden, weight, bias, targets = make_inputs(rows=512, device="cuda")
    weight.requires_grad_(True)

    def loss(h, w, b):
        return fastlm.linear_cross_entropy(h, w, targets, b, chunk_rows=128)

    compiled_code_launches(
        loss,
        (hidden, weight, bias),
        ("_cross_entropy_fused_kernel", "_scale_rows_kernel"),
        ("fastlm.linear_cross_entropy_gradients", "fastlm.cross_entropy_scale_rows_"),
    )
    check_against_float64(
        torch.compile(loss, fullgraph=True),
        lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b),
        (hidden, weight, bias),
        FP32_ALLOWANCE,
    )


@pytest.mark.gpu
def test_gpu_compiled_logits_are_never_copied():
    """At a vocabulary whose logits rows are not 128-byte aligned (1000 bf16; the traced path pads
    the weight to 1024 rows), no kernel Inductor generates moves a chunk of logits (128 x 1000 or
    128 x 1024 elements): the traced launches get row-aligned buffers, whole (a view they write
    would be cloned first)."""
    from torch._inductor.utils import run_and_get_code

    rows, width, vocab, chunk = 512, 64, 1000, 128
    hidden = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, w: fastlm.linear_cross_entropy(h, w, targets, chunk_rows=chunk), fullgraph=True)
    _, code = run_and_get_code(lambda: compiled(hidden, weight).backward())
    launches = re.findall(r"(triton_\w+)\.run\(([^\n]*)\)", "\n".join(code))
    sizes = {str(chunk * vocab), str(chunk * 1024)}
    copies = [name for name, args in launches if sizes & set(re.split(r"[ ,]+", args))]
    assert not copies, f"Inductor moves chunks of logits: {copies}"
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.gpu
def test_gpu_peak_memory_is_one_chunk_of_logits():
    """Besides the gradients (held from forward to backward), a step allocates about one chunk of
    logits, not the (N, V) logits: 8192 x 32000 bf16 logits would be 524 MB, a chunk is 33.5 MB."""
    rows, width, vocab, chunk = 8192, 1024, 32000, 512
    hidden = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    fastlm.linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk).backward()  # cuBLAS workspaces
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fastlm.linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk).backward()
    torch.cuda.synchronize()
    gradients = (hidden.numel() + weight.numel()) * 2
    chunk_bytes = chunk * vocab * 2
    assert torch.cuda.max_memory_allocated() - before - gradients < 1.5 * chunk_bytes
