"""`fastlm train --precision fp8`: the blocks' linear layers run `fastlm.fp8_linear` (not the LM
head), the run trains like the bf16 one within FP8's error, and a bf16 checkpoint continues in
fp8 (the weights are the same tensors in either precision). On a CPU ``torch._scaled_mm`` is
PyTorch's own kernel, and the other ops take their reference paths (TRITON_INTERPRET unset)."""

import pytest

import fastlm.layers.fp8 as fp8_layer
from fastlm.model import ModelConfig
from fastlm.model.precision import convert_for
from fastlm.train import loop
from fastlm.train.log import read_log

SETTINGS = ["--preset", "tiny", "--context", "16", "--micro-batch", "4", "--log-every", "1", "--eval-sequences", "4"]


@pytest.fixture(autouse=True)
def reference_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_log(out / "log.jsonl") if "loss" in r]


def _run(corpus_data, out, *argv) -> list[float]:
    assert loop.main(["--data", str(corpus_data), *SETTINGS, "--out", str(out), *argv]) == 0
    return _losses(out)


def test_the_blocks_linear_layers_convert_and_the_head_does_not():
    from fastlm.model import TransformerLM

    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=256, context_length=16))
    converted = convert_for(model, "fp8")
    assert len(converted) == 2 * 7  # q, k, v, o and the MLP's three in each of 2 blocks
    assert model.lm_head not in converted and "forward" not in model.lm_head.__dict__
    assert convert_for(model, "bf16") == []


def test_an_fp8_run_trains_as_the_bf16_run_does(corpus_data, tmp_path, monkeypatch):
    """20 steps that take the loss from 5.8 to about 3.2: each within 2% of the bf16 run's (measured
    0.3% at most); the blocks' matmuls went through fp8_linear, the LM head's did not."""
    shapes = []
    real = fp8_layer.fp8_linear
    monkeypatch.setattr(fp8_layer, "fp8_linear", lambda x, w, b=None: shapes.append(tuple(w.shape)) or real(x, w, b))
    schedule = ["--steps", "20", "--lr", "3e-3", "--warmup", "2"]
    fp8 = _run(corpus_data, tmp_path / "fp8", "--precision", "fp8", *schedule)
    assert shapes and (256, 64) not in shapes  # the tiny preset's LM head: (vocab, d_model)
    bf16 = _run(corpus_data, tmp_path / "bf16", "--precision", "bf16", *schedule)
    assert len(fp8) == len(bf16) == 20 and fp8[-1] < fp8[0] - 1
    for step, (a, b) in enumerate(zip(fp8, bf16, strict=True)):
        assert abs(a / b - 1) < 0.02, (step, a, b)


def test_a_bf16_checkpoint_continues_in_fp8(corpus_data, tmp_path):
    _run(corpus_data, tmp_path, "--precision", "bf16", "--steps", "2")
    _run(corpus_data, tmp_path, "--precision", "fp8", "--steps", "4", "--resume", "--override", "steps",
         "--override", "precision")  # fmt: skip
    steps = [r["step"] for r in read_log(tmp_path / "log.jsonl") if "loss" in r]
    assert steps[-1] == 4
