"""Padded batches in a patched Hugging Face model: a right- or left-padded 2-D attention_mask runs
each row's real tokens through the variable-length kernel (one sequence a row), with the unpatched
model's loss, gradients and logits at the real tokens; a mask with holes, and one under
torch.compile, keep transformers' SDPA; on a GPU the same in bf16, judged by the unpatched model's
own bf16 error."""

import copy
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastlm.integrations.huggingface import apply_fastlm, attention_function  # noqa: E402
from fastlm.integrations.huggingface import forwards as hf_forwards  # noqa: E402

from . import test_huggingface  # noqa: E402
from .test_huggingface import (  # noqa: E402
    FP32,
    LOGITS,
    assert_same_step,
    fallback_warnings,
    relative_error,
    tiny_model,
    tokens,
)

op_calls = test_huggingface.op_calls  # the fixture counting the fastlm ops the patch runs
no_tf32 = test_huggingface.no_tf32  # the fixture of full fp32 matmuls on the GPU
_fresh_warnings = test_huggingface._fresh_warnings  # autouse: each test sees the one-time warnings afresh

# real lengths of the rows of a 7-token batch: a row without padding, a row of one token, two between
LENGTHS = (7, 1, 4, 6)


def read_padding(kwargs: dict, inputs: torch.Tensor, is_causal: bool = True):
    """`_padding` of a call with ``kwargs`` and ``inputs`` (B, N) to a model of ``is_causal``."""
    model = SimpleNamespace(config=SimpleNamespace(is_causal=is_causal))
    return hf_forwards._padding(model, kwargs, inputs)


def padded_batch(side: str, lengths=LENGTHS, length: int = 7, device="cpu"):
    """(input_ids, attention_mask, labels) of rows with ``lengths`` real tokens, padded on ``side``
    with pad_token_id 0, their labels -100 (as DataCollatorForSeq2Seq pads them)."""
    ids = tokens(len(lengths), length).to(device)
    columns = torch.arange(length, device=device)[None]
    real = torch.tensor(lengths, device=device)[:, None]
    mask = ((columns < real) if side == "right" else (columns >= length - real)).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


# (family, what it adds): Llama; Mistral's window (3, shorter than the rows) inside each row;
# Mixtral's load-balancing loss, which reads the mask. What other families differ in comes before
# the attention function (test_huggingface.py), which is all that padding changes
CASES = {
    "llama": ("llama", {}),
    "mistral-window": ("mistral", {"sliding_window": 3}),
    "mixtral": ("mixtral", {"layers": 1}),  # one layer: its experts run under the interpreter
}


@pytest.mark.parametrize(
    ("case", "side"),
    [
        ("llama", "right"),
        ("llama", "left"),
        ("mistral-window", "right"),
        ("mistral-window", "left"),
        ("mixtral", "right"),
    ],
)
def test_padded_batch_matches_unpatched(case, side, op_calls, recwarn):
    """The loss and every gradient of a training step, then the logits at the real tokens in
    evaluation (no cache given: transformers makes an empty one itself), against the unpatched
    model's SDPA; with left padding the padded positions' logits too (SDPA gives their queries,
    which see no key, 0, as the kernel path does; the loss needs them: the last padded position
    predicts the first real token)."""
    family, overrides = CASES[case]
    model = tiny_model(family, **overrides)
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids, mask, labels = padded_batch(side)
    assert_same_step(model.train(), reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    layers = model.config.num_hidden_layers
    assert op_calls["flash_attention_varlen"] == layers and op_calls["flash_attention"] == 0  # one call a layer
    assert op_calls["rotary_embedding"] == layers  # one row of positions, arange(N), as unpatched
    model.eval(), reference.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], **LOGITS)
    if side == "left":
        torch.testing.assert_close(logits, expected, **LOGITS)
    assert not fallback_warnings(recwarn)


@pytest.mark.parametrize(
    ("side", "first_label", "attention", "unpadded"),
    [
        ("right", "kept", True, True),
        ("left", "ignored", True, True),
        ("left", "kept", True, False),
        ("right", "kept", False, False),
    ],
    ids=["right", "left", "left-first-token-a-target", "transformers-attention"],
)
def test_padded_training_runs_only_the_real_tokens(side, first_label, attention, unpadded, op_calls, recwarn):
    """In training with labels, every layer runs on the batch's real tokens laid end to end (one row
    of T tokens, not B x N positions), with the unpatched model's loss and gradients; the rotation
    runs its kernel on that one row of positions. Not where a padded position predicts a target
    (left padding whose first real token is a label: transformers counts that prediction), nor with
    transformers' attention (it would see one sequence)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_fastlm(model, attention=attention)
    ids, mask, labels = padded_batch(side)
    if first_label == "ignored":  # as a prompt's tokens are: only the response is learned
        labels[torch.arange(len(labels)), mask.argmax(dim=1)] = -100
    shapes = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: shapes.append(args[0].shape[:2]))
    assert_same_step(model.train(), reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    assert shapes == [(1, int(mask.sum())) if unpadded else tuple(ids.shape)]
    assert op_calls["flash_attention_varlen"] == (2 if attention else 0) and op_calls["rotary_embedding"] == 2
    assert not fallback_warnings(recwarn)


def test_padding_with_position_ids_and_without_cache_matches_unpatched(op_calls, recwarn):
    """Per-row position ids counting from each row's first real token (what generation and some
    trainers pass with left padding) and use_cache=False: transformers reads no packing from them
    when a mask is given; the patched model keeps each row one sequence, and the rotation takes
    transformers' path (per-row positions)."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids, mask, labels = padded_batch("left")
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, position_ids=positions, use_cache=False)
    assert_same_step(model.train(), reference.train(), **inputs)
    assert op_calls["flash_attention_varlen"] == 2 and op_calls["rotary_embedding"] == 0
    assert not fallback_warnings(recwarn)


def test_gradient_checkpointing_with_padding_matches_unpatched(op_calls, recwarn):
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable()
    ids, mask, labels = padded_batch("right")
    assert_same_step(model.train(), reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    assert op_calls["flash_attention_varlen"] == 4  # each layer's forward again in the backward
    assert not fallback_warnings(recwarn)


def test_mask_with_holes_runs_sdpa_with_a_warning(op_calls, recwarn):
    """A row whose real tokens are not contiguous is no sequence of the varlen kernel: the mask goes
    to transformers and SDPA, warned once."""
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids, mask, labels = padded_batch("left")
    mask[0, 3] = 0  # a hole in the unpadded row
    labels[0, 3] = -100
    assert_same_step(model.train(), reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    model(input_ids=ids, attention_mask=mask, labels=labels)
    assert op_calls["flash_attention_varlen"] == 0
    assert len(fallback_warnings(recwarn)) == 1 and "attention mask" in fallback_warnings(recwarn)[0]


def test_torch_compile_keeps_sdpa_for_padding(op_calls, recwarn):
    """Reading the mask decides the path (holes, no padding) and the number of real tokens from its
    values, on which a trace cannot branch (Dynamo: a guard on a data-dependent expression): under
    torch.compile the mask goes to transformers, and SDPA computes the padded batch (no warning
    while tracing) in one graph."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids, mask, labels = padded_batch("right")
    torch._dynamo.reset()
    compiled = torch.compile(model.train(), backend="aot_eager", fullgraph=True)
    assert_same_step(compiled, reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    assert op_calls["flash_attention_varlen"] == 0 and op_calls["flash_attention"] == 0


def test_padding_is_read_once_per_forward(monkeypatch):
    """`_padding` on the masks it serves and those it leaves to transformers; one read per forward."""
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])  # left, right, empty, full
    padding = read_padding({"attention_mask": mask}, torch.zeros(4, 4))
    assert torch.equal(padding.mask, mask.bool())
    assert padding.rows.tolist() == [0, 0, 1, 1, 1, 3, 3, 3, 3]
    assert padding.positions.tolist() == [2, 3, 0, 1, 2, 0, 1, 2, 3]
    assert padding.cu_seqlens.tolist() == [0, 2, 5, 5, 9] and padding.cu_seqlens.dtype == torch.int32
    assert padding.max_seqlen == 4
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    ones, inputs = torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4)
    assert read_padding({"attention_mask": holes}, inputs) is None
    assert read_padding({"attention_mask": ones}, inputs) is None  # transformers drops it itself
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert read_padding({"attention_mask": left, "past_key_values": object()}, inputs) is None
    assert read_padding({"attention_mask": left[:, None, None]}, inputs) is None  # 4-D
    assert read_padding({"attention_mask": left}, torch.zeros(2, 5)) is None  # a prefix's mask
    assert read_padding({"attention_mask": left}, inputs, is_causal=False) is None  # bidirectional
    assert read_padding({"attention_mask": left}, inputs) is not None

    reads = []
    real_padding = hf_forwards._padding
    monkeypatch.setattr(hf_forwards, "_padding", lambda *args: reads.append(1) or real_padding(*args))
    model = tiny_model("llama", layers=3)
    apply_fastlm(model)
    ids, mask, labels = padded_batch("right")
    model.train()(input_ids=ids, attention_mask=mask, labels=labels)
    assert len(reads) == 1


def _module():
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    return module


@pytest.mark.parametrize("window", [None, 2])
def test_padded_attention_is_sdpa_at_real_queries_and_zero_at_padded_ones(window, recwarn):
    """attention_function with the `Padding` of a batch (left, right, no padding, an empty row)
    against transformers' SDPA with the mask transformers builds from it: equal outputs and
    gradients at the real queries, 0 at the padded ones; under dropout SDPA runs, with that mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    padding = read_padding({"attention_mask": mask}, torch.zeros(4, 5))
    q, k, v = (torch.randn(4, heads, 5, 8, requires_grad=True) for heads in (4, 2, 2))
    rows, cols = torch.arange(5)[:, None], torch.arange(5)[None, :]
    visible = (cols <= rows) & (cols > rows - (window or 5))
    sdpa_mask = (visible & mask.bool()[:, None, :])[:, None]  # (B, 1, N, N), as transformers builds it
    kwargs = {"scaling": 0.3, "sliding_window": window}
    out, _ = attention_function(_module(), q, k, v, None, fastlm_plain_causal=True, fastlm_padding=padding, **kwargs)
    expected, _ = sdpa_attention_forward(_module(), q, k, v, sdpa_mask, **kwargs)
    real = mask.bool()
    torch.testing.assert_close(out[real], expected[real], **FP32)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    weights = torch.randn_like(out)
    gradients = torch.autograd.grad((out[real] * weights[real]).sum(), (q, k, v))
    expected_gradients = torch.autograd.grad((expected[real] * weights[real]).sum(), (q, k, v))
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected_gradient, **FP32)
    assert not fallback_warnings(recwarn)

    torch.manual_seed(1)  # dropout draws the same mask in both
    out, _ = attention_function(
        _module(), q, k, v, None, dropout=0.5, fastlm_plain_causal=True, fastlm_padding=padding, **kwargs
    )
    torch.manual_seed(1)
    expected, _ = sdpa_attention_forward(_module(), q, k, v, sdpa_mask, dropout=0.5, **kwargs)
    torch.testing.assert_close(out, expected)
    assert "attention dropout" in fallback_warnings(recwarn)[0]


# ----------------------------------------------------------------------------------------------
# GPU: the Triton kernels at a moderate size, long-tailed lengths
# ----------------------------------------------------------------------------------------------

# 4 rows of 256 tokens: one full, one of a single token, a short and a long one
GPU_LENGTHS = (256, 1, 37, 190)


def padded_step(model, ids, mask, labels, autocast: bool):
    """The loss and every parameter's gradient of one training step on a padded batch, on the GPU."""
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return [loss.detach()] + [param.grad.detach().clone() for param in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("window", [None, 48])
def test_padded_batch_matches_unpatched_on_gpu(side, window, no_tf32, op_calls, recwarn):
    """fp32 through the GPU kernels: the padded step and the real tokens' logits as unpatched."""
    model = tiny_model("mistral", sliding_window=window).cuda()
    reference = copy.deepcopy(model)
    apply_fastlm(model)
    ids, mask, labels = padded_batch(side, GPU_LENGTHS, 256, device="cuda")
    assert_same_step(model.train(), reference.train(), input_ids=ids, attention_mask=mask, labels=labels)
    assert op_calls["flash_attention_varlen"] == 2 and not fallback_warnings(recwarn)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, attention_mask=mask).logits
        expected = reference.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], **LOGITS)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16-weights", "bf16-autocast"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_bf16_error_is_within_the_unpatched_models(side, precision, no_tf32, op_calls):
    """Against the fp32 unpatched model on the same padded batch, the patched model's loss and every
    gradient are no further than 1.5x the unpatched model's own bf16 error, plus a floor, as
    `test_bf16_error_is_within_the_unpatched_models` judges unpadded batches."""
    exact_model = tiny_model("llama", layers=4, hidden=512, heads=8, initializer_range=0.02).cuda()
    ids, mask, labels = padded_batch(side, GPU_LENGTHS, 256, device="cuda")
    exact = padded_step(exact_model.train(), ids, mask, labels, autocast=False)
    autocast = precision == "bf16-autocast"
    unpatched = copy.deepcopy(exact_model) if autocast else copy.deepcopy(exact_model).bfloat16()
    patched = copy.deepcopy(unpatched)
    apply_fastlm(patched)
    baseline = padded_step(unpatched.train(), ids, mask, labels, autocast)
    values = padded_step(patched.train(), ids, mask, labels, autocast)
    assert op_calls["flash_attention_varlen"] == 4  # the patched model's 4 layers, the others run SDPA
    names = ["loss"] + [name for name, _ in exact_model.named_parameters()]
    for name, value, reference, exact_value in zip(names, values, baseline, exact, strict=True):
        allowed = 1.5 * relative_error(reference, exact_value) + 1e-4
        assert relative_error(value, exact_value) <= allowed, name
