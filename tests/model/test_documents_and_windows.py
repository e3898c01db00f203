"""Packed documents and sliding windows in the model: attention never crosses a document boundary
or reaches past the window, for every attention kernel, with the same numbers as the documents run
one by one (and as the masks written out)."""

import dataclasses

import numpy as np
import pytest
import torch

from fastlm.data.documents import MIN_DOCUMENTS, cu_seqlens
from fastlm.model import ModelConfig, TransformerLM

TINY = ModelConfig.preset("tiny", vocab_size=61, context_length=32)
BOUNDARY = 60
ATTENTION = ["naive", "sdpa", "fastlm"]


def packed_rows(lengths_per_row, seed=0):
    """(B, N) tokens whose rows hold documents of the given lengths, each starting with BOUNDARY
    (except possibly a row's first, which starts a document anyway); the documents as a list."""
    generator = torch.Generator().manual_seed(seed)
    rows, documents = [], []
    for index, lengths in enumerate(lengths_per_row):
        parts = []
        for number, length in enumerate(lengths):
            doc = torch.randint(0, BOUNDARY, (length,), generator=generator)
            if number or index % 2:  # odd rows start with a boundary too, even rows mid-document
                doc[0] = BOUNDARY
            parts.append(doc)
            documents.append(doc)
        rows.append(torch.cat(parts))
    return torch.stack(rows), documents


def test_cu_seqlens_starts_at_every_boundary_and_every_row_and_pads_to_a_power_of_two():
    tokens = np.array([[5, 60, 1, 2, 60, 3], [60, 4, 4, 4, 60, 60]])
    bounds = cu_seqlens(tokens, 60)
    assert bounds.dtype == np.int32
    assert bounds[:8].tolist() == [0, 1, 4, 6, 10, 11, 12, 12]
    assert len(bounds) == MIN_DOCUMENTS + 1 and (bounds[7:] == 12).all()
    many = np.full((2, 100), 60)  # 200 one-token documents: padded to 256
    assert len(cu_seqlens(many, 60)) == 257


@pytest.mark.parametrize("attention", ATTENTION)
def test_packed_documents_equal_the_documents_run_alone(attention):
    config = TINY.with_kernels(attention=attention)
    model = TransformerLM(config)
    tokens, documents = packed_rows([[5, 1, 10], [7, 9]])
    bounds = torch.from_numpy(cu_seqlens(tokens.numpy(), BOUNDARY))
    with torch.no_grad():
        packed = model(tokens, cu_seqlens=bounds).flatten(0, 1)
        alone = torch.cat([model(doc[None])[0] for doc in documents])
        whole_rows = model(tokens).flatten(0, 1)
    # fp32 (the kernels' widest type), and a document sits at other positions packed: fp32-level agreement
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(whole_rows, alone, rtol=1e-3, atol=1e-3)  # unpacked, documents see earlier ones


@pytest.mark.parametrize("attention", ATTENTION)
def test_a_window_sees_only_the_last_keys_and_global_layers_see_all(attention):
    """The windowed model's logits depend on no token more than (window - 1) x layers back."""
    window = 3
    config = dataclasses.replace(TINY.with_kernels(attention=attention), window=window)
    model = TransformerLM(config)
    tokens = torch.randint(0, 60, (1, 16))
    reach = (window - 1) * config.num_layers  # how far back a token's influence can travel
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 60
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert not torch.allclose(before[0, reach], after[0, reach])
    torch.testing.assert_close(before[0, reach + 1 :], after[0, reach + 1 :], rtol=0, atol=0)
    with torch.no_grad():  # every block global: the first token reaches the last
        global_model = TransformerLM(dataclasses.replace(config, global_every=1))
        assert not torch.allclose(global_model(tokens)[0, -1], global_model(changed)[0, -1])


@pytest.mark.parametrize(("attention", "softmax"), [("sdpa", "torch"), ("fastlm", "torch"), ("naive", "fastlm")])
def test_kernels_agree_with_naive_attention_on_windows_and_documents(attention, softmax, monkeypatch):
    """Documents, a window and a global layer together: loss and gradients as the naive masks give
    (also through the fused masked softmax, which takes them as an additive mask). fastlm's attention
    on its CPU path: the interpreter's packed kernels take 13 s a launch here, and run against the
    reference in test_flash_attention_varlen.py, in the model on a GPU below."""
    if attention == "fastlm":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    config = dataclasses.replace(TINY, num_layers=2, window=4, global_every=2)  # windowed, then global
    reference = TransformerLM(config.with_kernels(attention="naive"))
    model = TransformerLM(config.with_kernels(attention=attention, softmax=softmax))
    model.load_state_dict(reference.state_dict())
    tokens, _ = packed_rows([[9, 12, 3], [2, 20, 2]], seed=1)
    targets = torch.randint(0, 60, tokens.shape)
    bounds = torch.from_numpy(cu_seqlens(tokens.numpy(), BOUNDARY))
    expected, actual = reference(tokens, targets, bounds), model(tokens, targets, bounds)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    expected.backward()
    actual.backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_layer_windows_follow_global_every():
    config = dataclasses.replace(TINY, num_layers=6, window=128, global_every=3)
    assert [config.layer_window(i) for i in range(6)] == [128, 128, None, 128, 128, None]
    assert dataclasses.replace(config, global_every=0).layer_window(2) == 128
    assert dataclasses.replace(config, window=None, global_every=0).layer_window(0) is None


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        (torch.tensor([0, 8, 16]), "int32"),
        (torch.tensor([0, 8, 12], dtype=torch.int32), r"rise from 0 to 16"),
        (torch.tensor([0, 9, 5, 16], dtype=torch.int32), "without falling"),
        (torch.tensor([0, 3, 16], dtype=torch.int32), "every row start"),
    ],
)
def test_bad_cu_seqlens_raise_one_clear_error(bounds, message):
    model = TransformerLM(TINY)
    with pytest.raises(ValueError, match=message):
        model(torch.randint(0, 60, (2, 8)), cu_seqlens=bounds)


def test_numpy_cu_seqlens_are_named_as_such():
    """`fastlm.data.documents.cu_seqlens` returns numpy: the error says to convert it."""
    with pytest.raises(TypeError, match=r"got ndarray \(from numpy: torch.from_numpy"):
        TransformerLM(TINY)(torch.randint(0, 60, (2, 8)), cu_seqlens=np.array([0, 8, 16], dtype=np.int32))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"window": 0}, "window must be"),
        ({"window": 4, "global_every": -1}, "global_every"),
        ({"global_every": 2}, "needs a window"),
    ],
)
def test_bad_window_configs_raise_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **overrides)


@pytest.mark.gpu
def test_gpu_fastlm_documents_and_windows_match_sdpa_in_bf16():
    """The CUDA varlen and window kernels in the model, bf16 autocast: loss and gradients as SDPA's
    masks give, at bf16 tolerance."""
    config = ModelConfig.preset(
        "tiny", d_model=256, d_ff=704, num_heads=4, num_layers=3, vocab_size=512, context_length=256, window=48
    )
    config = dataclasses.replace(config, global_every=3)
    reference = TransformerLM(config.with_kernels(attention="sdpa")).cuda()
    model = TransformerLM(config.with_kernels(attention="fastlm")).cuda()
    model.load_state_dict(reference.state_dict())
    generator = np.random.default_rng(0)
    rows = generator.integers(0, 511, (4, 256))
    rows[generator.random(rows.shape) < 0.02] = 511  # about 5 documents per row
    bounds = torch.from_numpy(cu_seqlens(rows, 511)).cuda()
    tokens, targets = torch.from_numpy(rows).cuda(), torch.randint(0, 512, rows.shape, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, actual = reference(tokens, targets, bounds), model(tokens, targets, bounds)
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)
    expected.backward()
    actual.backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        scale = p.grad.abs().max()
        torch.testing.assert_close(q.grad / scale, p.grad / scale, rtol=0, atol=5e-2, msg=name)


def test_masks_are_built_once_per_window_and_required_by_the_torch_kernels():
    config = dataclasses.replace(TINY, num_layers=4, window=4, global_every=2)
    model = TransformerLM(config)
    tokens, _ = packed_rows([[9, 12, 3], [2, 20, 2]])
    bounds = torch.from_numpy(cu_seqlens(tokens.numpy(), BOUNDARY))
    masks = model.attention_masks(bounds, *tokens.shape, tokens.device)
    assert set(masks) == {4, None} and masks[4].shape == (2, 1, 24, 24)  # one per window, every layer shares it
    assert model.attention_masks(None, *tokens.shape, tokens.device)[None] is None  # global and one document
    assert TransformerLM(TINY.with_kernels(attention="fastlm")).attention_masks(bounds, 2, 24, "cpu") is None
    with pytest.raises(ValueError, match="as a mask"):
        model.blocks[0](torch.randn(2, 24, config.d_model), bounds)
