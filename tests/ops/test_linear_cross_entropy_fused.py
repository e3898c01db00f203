"""fastlm.linear_cross_entropy(impl="fused"), the fully fused Triton kernels, against the float64
reference: losses and every gradient, every option, tiles and splits chosen to leave partial blocks.

On CPU the kernels run through the Triton interpreter (conftest sets TRITON_INTERPRET=1). Its
default config (INTERPRETER_CONFIG: 16-row, 32-class, 16-wide tiles, two vocabulary splits) already
cuts the shared shapes (N, d, V) = (21, 29, 131) into two token blocks (the second partial), five
vocabulary tiles (the last 3 classes wide) split 3 + 2, and two width steps (the second partial);
the explicit configs below move those boundaries. The `gpu` tests compare with the chunked
implementation at a realistic size and check what only a GPU has (Inductor's code, memory).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.nn import LinearCrossEntropyLoss
from fastlm.ops import linear_cross_entropy as lce
from fastlm.ops import linear_cross_entropy_fused as lcef
from fastlm.ops.linear_cross_entropy import LossOptions, linear_cross_entropy_ref
from fastlm.ops.linear_cross_entropy_fused import (
    DEFAULT_CONFIG,
    INTERPRETER_CONFIG,
    LinearCrossEntropyKernels,
    linear_cross_entropy_fused_config,
)

from .launches import compiled_code_launches
from .reference import check_against_float64, normwise_error, unit_roundoff
from .test_cross_entropy import poisoned_outputs  # noqa: F401 (a fixture)
from .test_linear_cross_entropy import (
    FP32_ALLOWANCE,
    REDUCTIONS,
    V,
    bf16_results,
    check_fp32,
    leaves,
    make_inputs,
)

# 16-class tiles: 9 tiles (the last 3 classes wide), 3 splits of 3 tiles
THREE_SPLITS = dataclasses.replace(INTERPRETER_CONFIG, block_v=16, split_v=3)
CONFIGS = [
    pytest.param(THREE_SPLITS, id="3-splits"),
    # more splits asked than tiles: one per tile, the last split 3 classes wide
    pytest.param(dataclasses.replace(INTERPRETER_CONFIG, block_v=16, split_v=100), id="split-per-tile"),
    # one tile wider than V, one token block wider than N, one width step wider than d
    pytest.param(
        dataclasses.replace(INTERPRETER_CONFIG, block_n=32, block_v=256, block_d=32, split_v=4), id="one-tile"
    ),
]
# Every option at once, per-row losses with a random upstream gradient per row
ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, reduction="none")


def check_fused(hidden, weight, bias, targets, config="fused", **options):
    """`check_fp32` through the fused kernels: impl="fused" (the picked config) or a config."""
    check_fp32(hidden, weight, bias, targets, chunk_rows=None, impl=config, **options)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_reference(reduction, bias, device):
    hidden, weight, bias_, targets = make_inputs(bias=bias, device=device)
    check_fused(hidden, weight, bias_, targets, reduction=reduction)


@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.1),
        dict(z_loss=1e-2),
        dict(softcap=2.0),  # below the logits' spread: tanh saturates for many of them
        dict(ignore_index=3),  # an ignore_index inside [0, V) wins over being a valid class
        dict(label_smoothing=1.0, softcap=5.0, reduction="sum"),
        ALL_OPTIONS,
    ],
)
def test_options_match_reference(options, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    targets[targets == -100] = options.get("ignore_index", -100)
    targets[1:3] = 3
    check_fused(hidden, weight, bias, targets, **options)


@pytest.mark.parametrize("config", CONFIGS)
def test_configs_match_reference(config, device):
    """Tile and split boundaries elsewhere; label smoothing makes the combine re-centre each split's
    sum of logits, however many classes the split has."""
    hidden, weight, bias, targets = make_inputs(device=device)
    check_fused(hidden, weight, bias, targets, config, **ALL_OPTIONS)


@pytest.mark.parametrize(
    "rows,width,vocab",
    [
        (1, 1, 1),  # one token, width 1, one class: loss 0 up to the z-loss, gradient from it alone
        (1, 29, 131),  # one token: a single, mostly masked token block
        (13, 16, 32),  # a prime of tokens; width one step, vocabulary one tile exactly (no masking)
        (17, 33, 97),  # 16 + 1 tokens and width 32 + 1: a second block of one; a prime vocabulary
    ],
)
def test_shapes_match_reference(rows, width, vocab, device):
    hidden, weight, bias, targets = make_inputs(rows=rows, width=width, vocab=vocab, device=device)
    check_fused(hidden, weight, bias, targets, label_smoothing=0.1, z_loss=1e-2, reduction="none")


def test_large_logits_as_accurate_as_torch(device):
    """Logits offset by 3e4 (fp32 spacing 0.002 there): the loss is formed from differences to the
    row max, and the split sums of logits re-centred on it, so fastlm's error stays torch's."""
    hidden, weight, bias, targets = make_inputs(device=device)
    check_fused(hidden, weight, bias + 3e4, targets, label_smoothing=0.1, reduction="none")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bf16_matches_reference(reduction, device):
    hidden, weight, bias, targets = make_inputs(torch.bfloat16, device=device)
    upstream = torch.rand((hidden.shape[0],) if reduction == "none" else (), device=device) + 0.5
    bf16_results(hidden, weight, bias, targets, upstream, reduction=reduction, softcap=5.0, label_smoothing=0.1,
                 impl="fused")  # fmt: skip


def test_autocast_with_fp32_weight(device):
    """A model's fp32 master weight under bf16 autocast: bf16 tiles, and the weight and bias
    gradients accumulated in fp32 buffers returned as they are."""
    hidden, weight, bias, targets = make_inputs(device=device)
    _, _, grad_weight, grad_bias = bf16_results(hidden, weight, bias, targets, torch.tensor(1.0, device=device),
                                                autocast=True, impl="fused")  # fmt: skip
    assert grad_weight.dtype == grad_bias.dtype == torch.float32
    assert not torch.equal(grad_weight, grad_weight.bfloat16().float()), "weight gradient rounded to bf16"


@pytest.mark.parametrize(
    "trainable,reduction",
    [(("hidden",), "mean"), (("weight", "bias"), "none")],  # a frozen LM head; a frozen trunk
)
def test_gradients_only_where_required(trainable, reduction, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    check_fused(hidden, weight, bias, targets, trainable=trainable, reduction=reduction)


def test_without_grad(device):
    hidden, weight, bias, targets = make_inputs(device=device)

    def under_no_grad(h, w, b):  # on inputs that require grad
        with torch.no_grad():
            return fastlm.linear_cross_entropy(*leaves(h, w), targets, b, impl="fused")

    loss = check_against_float64(under_no_grad, lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b),
                                 (hidden, weight, bias), FP32_ALLOWANCE)  # fmt: skip
    assert loss.grad_fn is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored_follows_torch(reduction, device):
    hidden, weight, bias, _ = make_inputs(device=device)
    targets = torch.full((hidden.shape[0],), -100, device=device)
    inputs = leaves(hidden, weight, bias)
    loss = fastlm.linear_cross_entropy(inputs[0], inputs[1], targets, inputs[2], reduction=reduction, impl="fused")
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction=reduction)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0, equal_nan=True)  # NaN, 0, zeros
    loss.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in inputs)  # zeros, not NaN


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_follows_torch(reduction, device):
    hidden, weight, bias = leaves(*make_inputs(rows=0, device=device)[:3])
    targets = torch.zeros(0, dtype=torch.long, device=device)
    loss = fastlm.linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction, impl="fused")
    expected = F.cross_entropy(F.linear(hidden, weight, bias).detach(), targets, reduction=reduction)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0, equal_nan=True)  # mean: NaN; sum: 0
    loss.sum().backward()
    assert hidden.grad.shape == hidden.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_output_written(reduction, device):
    """Buffers from torch.empty start as NaN: the kernels write every partial, loss and statistic
    (the gradients accumulate into zero-filled buffers)."""
    hidden, weight, bias, targets = make_inputs(device=device)
    inputs = leaves(hidden, weight, bias)
    loss = fastlm.linear_cross_entropy(inputs[0], inputs[1], targets, inputs[2], reduction=reduction,
                                       label_smoothing=0.1, impl="fused")  # fmt: skip
    loss.sum().backward()
    assert not loss.isnan().any() and not any(t.grad.isnan().any() for t in inputs)


def test_target_out_of_range_gives_nan_rows(device):
    """What CUDA does for a target outside [0, V) (a CPU call raises before any kernel): that row's
    loss and gradient are NaN, the others exact, as in fastlm.cross_entropy."""
    hidden, weight, bias, targets = make_inputs(device=device)
    targets[5] = V
    inputs = leaves(hidden, weight, bias)
    options = LossOptions(-100, 0.0, 0.0, None)
    losses = LinearCrossEntropyKernels.apply(inputs[0], inputs[1], targets, inputs[2], options, None)
    losses.backward(torch.ones_like(losses))
    valid = torch.arange(hidden.shape[0], device=device) != 5
    assert losses[5].isnan() and not losses[valid].isnan().any()
    assert inputs[0].grad[5].isnan().all() and not inputs[0].grad[valid].isnan().any()
    expected = linear_cross_entropy_ref(hidden[valid].double(), weight.double(), targets[valid], bias.double(),
                                        reduction="none")  # fmt: skip
    torch.testing.assert_close(losses[valid].double(), expected, rtol=1e-5, atol=1e-5)


def test_second_backward_recomputes(device):
    """The fused path keeps no gradients between forward and backward, so retain_graph=True works
    (the chunked mean / sum path refuses it) and gives the same gradients again."""
    hidden, weight, _, targets = make_inputs(bias=False, device=device)
    hidden, weight = leaves(hidden, weight)
    loss = fastlm.linear_cross_entropy(hidden, weight, targets, impl="fused")
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # atomics: sums in any order


def test_impl_picks_the_implementation(monkeypatch, device):
    """impl="fused" and a config run the kernels, never the chunk loops; None and "chunked" run the
    chunk loops, never the kernels."""
    hidden, weight, bias, targets = make_inputs(device=device)

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"{name} ran")

        return fail

    def run(impl):
        inputs = leaves(hidden, weight, bias)
        fastlm.linear_cross_entropy(inputs[0], inputs[1], targets, inputs[2], impl=impl).backward()

    with monkeypatch.context() as patch:
        for name in ("_chunked_losses", "_chunked_gradients"):
            patch.setattr(lce, name, forbidden(name))
        run("fused")
        run(THREE_SPLITS)
    monkeypatch.setattr(lcef, "_fused_forward", forbidden("_fused_forward"))
    run(None)
    run("chunked")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_path_without_interpreter(reduction, monkeypatch):
    """CPU without TRITON_INTERPRET: the launchers' plain-PyTorch path, same values."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(lcef, "_kernel_gradients", None)  # called, it would fail
    hidden, weight, bias, targets = make_inputs()
    check_fused(hidden, weight, bias, targets, reduction=reduction, softcap=5.0, label_smoothing=0.1, z_loss=1e-3)


def test_module_passes_impl(monkeypatch, device):
    hidden, weight, bias, targets = make_inputs(device=device)
    module = LinearCrossEntropyLoss(reduction="sum", z_loss=1e-3, impl="fused")
    monkeypatch.setattr(lce, "_chunked_gradients", None)  # the chunked path would fail
    check_against_float64(lambda h, w, b: module(h, w, targets, b),
                          lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b, reduction="sum", z_loss=1e-3),
                          leaves(hidden, weight, bias), FP32_ALLOWANCE)  # fmt: skip
    assert "chunk_rows=None, impl='fused'" in repr(module)


def test_torch_compile_fullgraph(device):
    """impl="fused" compiles without graph breaks into the two registered ops and their autograd
    (on CPU into their plain-PyTorch path: the interpreter cannot run on a trace's fake tensors)."""
    hidden, weight, bias, targets = make_inputs(device=device)
    options = dict(reduction="mean", softcap=5.0, z_loss=1e-3, impl="fused")

    def loss_and_grads(fn):
        inputs = leaves(hidden, weight, bias)
        loss = fn(*inputs)
        loss.backward()
        return [loss.detach(), *(t.grad for t in inputs)]

    def step(h, w, b):
        return fastlm.linear_cross_entropy(h, w, targets, b, **options)

    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, loss_and_grads(step), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_registered_op_passes_opcheck(device):
    """Schema, fake-tensor and autograd registration of the forward op (with its backward op), the
    kernels run eagerly on the interpreter (9 rows: opcheck runs the op several times)."""
    hidden, weight, bias, targets = (t[:9] if t.shape[0] == 21 else t for t in make_inputs(device=device))
    hidden, weight, bias = leaves(hidden, weight, bias)
    other_ignored = torch.where(targets == -100, 3, targets)
    for args in ((hidden, weight, targets, bias, -100, 0.1, 1e-3, 5.0),
                 (hidden, weight, other_ignored, None, 3, 0.0, 0.0, None)):  # fmt: skip
        torch.library.opcheck(torch.ops.fastlm.linear_cross_entropy_fused_forward, args)


def test_config_pick():
    """The sm90 guesses, fp32 with half-width steps, tiles no wider than the operands, the default
    elsewhere, the interpreter's small tiles; cached; bad tiles rejected when the config is made."""
    h100 = linear_cross_entropy_fused_config(90, torch.bfloat16, 128256, 4096)
    assert (h100.block_n, h100.block_v, h100.block_d, h100.num_warps, h100.num_stages) == (128, 128, 64, 8, 3)
    assert linear_cross_entropy_fused_config(90, torch.float32, 128256, 4096).block_d == 32
    small = linear_cross_entropy_fused_config(90, torch.bfloat16, 50, 20)
    assert (small.block_v, small.block_d) == (64, 32)  # next powers of two of 50 and 20
    assert linear_cross_entropy_fused_config(90, torch.bfloat16, 3, 1).block_d == 16  # tl.dot's smallest
    assert linear_cross_entropy_fused_config(80, torch.bfloat16, 32000, 1024) == DEFAULT_CONFIG
    assert linear_cross_entropy_fused_config(0, torch.bfloat16, 32000, 1024) == INTERPRETER_CONFIG
    assert linear_cross_entropy_fused_config(90, torch.bfloat16, 128256, 4096) is h100
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16, got 24"):
        dataclasses.replace(DEFAULT_CONFIG, block_v=24)
    with pytest.raises(ValueError, match="must be >= 1"):
        dataclasses.replace(DEFAULT_CONFIG, split_v=0)


@pytest.mark.parametrize(
    "split_v,tiles,expected",
    [
        (2, 5, (2, 3 * 32)),  # 3 + 2 tiles
        (4, 5, (3, 2 * 32)),  # 2 + 2 + 1: a fourth split would be empty
        (100, 5, (5, 32)),  # at most one split per tile
        (1, 5, (1, 5 * 32)),
    ],
)
def test_vocabulary_splits(split_v, tiles, expected):
    """(splits, classes per split) of the forward grid: every split nonempty."""
    config = dataclasses.replace(INTERPRETER_CONFIG, split_v=split_v)
    assert lcef._vocabulary_splits(config, 2, tiles, torch.device("cpu")) == expected


# ---------------------------------------------------------------------------------------------
# GPU: a realistic size against the chunked implementation, Inductor's code, memory
# ---------------------------------------------------------------------------------------------


def _gpu_inputs(rows, width, vocab, dtype):
    hidden = torch.randn(rows, width, device="cuda", dtype=dtype)
    weight = (torch.randn(vocab, width, device="cuda") * 3 / width**0.5).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::7] = -100
    return hidden, weight, targets


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_matches_chunked_and_reference(autocast):
    """N=4096, d=1024, V=32000: bf16 (or an fp32 master weight under bf16 autocast), reduction
    "mean", label smoothing: within bf16's allowance of the float64 reference, and close to the
    chunked implementation."""
    hidden, weight, targets = _gpu_inputs(4096, 1024, 32000, torch.float32 if autocast else torch.bfloat16)
    one = torch.tensor(1.0, device="cuda")
    fused = bf16_results(hidden, weight, None, targets, one, autocast=autocast, label_smoothing=0.1, impl="fused")
    chunked = bf16_results(hidden, weight, None, targets, one, autocast=autocast, label_smoothing=0.1,
                           impl="chunked")  # fmt: skip
    for ours, theirs in zip(fused, chunked, strict=True):  # each rounded to bf16 once, at different points
        assert ours.dtype == theirs.dtype
        assert normwise_error(ours, theirs) < 2 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_fused_kernels():
    hidden, weight, bias, targets = make_inputs(rows=512, device="cuda")
    weight.requires_grad_(True)

    def loss(h, w, b):
        return fastlm.linear_cross_entropy(h, w, targets, b, impl="fused", z_loss=1e-4)

    compiled_code_launches(loss, (hidden, weight, bias),
                           ("_linear_xent_forward_kernel", "_linear_xent_combine_kernel",
                            "_linear_xent_backward_kernel"),
                           ("fastlm.linear_cross_entropy_fused_forward",
                            "fastlm.linear_cross_entropy_fused_backward"))  # fmt: skip
    check_against_float64(torch.compile(loss, fullgraph=True),
                          lambda h, w, b: linear_cross_entropy_ref(h, w, targets, b, z_loss=1e-4),
                          (hidden, weight, bias), FP32_ALLOWANCE)  # fmt: skip


@pytest.mark.gpu
def test_gpu_peak_memory_holds_no_logits():
    """Besides the gradients, a step allocates the fp32 accumulators (N d + V d floats: 164 MB
    here) and small buffers, not the 524 MB of bf16 logits nor one chunk of them."""
    rows, width, vocab = 8192, 1024, 32000
    hidden, weight, targets = _gpu_inputs(rows, width, vocab, torch.bfloat16)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    fastlm.linear_cross_entropy(hidden, weight, targets, impl="fused").backward()  # compiles the kernels
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fastlm.linear_cross_entropy(hidden, weight, targets, impl="fused").backward()
    torch.cuda.synchronize()
    gradients = (rows + vocab) * width * 2
    accumulators = (rows + vocab) * width * 4
    assert torch.cuda.max_memory_allocated() - before - gradients < accumulators + 16 * 2**20
