"""`fastlm train lm`: the byte corpus, its windows, and training with both kernel sets (CPU; CUDA graphs on a GPU)."""

from pathlib import Path

import pytest
import torch

from fastlm.cli import main
from fastlm.tasks.text_training import TextSettings, load_corpus, split_windows, train_kernels

CORPUS = Path(__file__).parent.parent / "data" / "corpus.txt"


def test_corpus_is_its_utf8_bytes(tmp_path):
    tokens = load_corpus(CORPUS)
    assert tokens.dtype == torch.int64 and len(tokens) == CORPUS.stat().st_size
    assert bytes(tokens.tolist()).decode("utf-8") == CORPUS.read_text(encoding="utf-8")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Gr\xf6\xdfe".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_corpus(bad)


def test_windows_are_disjoint_and_held_out_is_the_tail():
    tokens = torch.arange(1000) % 256
    train, held_out = split_windows(tokens, context=9)  # windows of 10 bytes
    assert train.shape == (90, 10) and held_out.shape == (10, 10)
    assert torch.equal(train.flatten(), tokens[:900]) and torch.equal(held_out.flatten(), tokens[900:1000])
    with pytest.raises(ValueError, match="too small"):
        split_windows(tokens[:50], context=9)


def test_kernel_sets_train_alike():
    train, held_out = split_windows(load_corpus(CORPUS), context=16)
    windows = (train[:32], held_out[:2])  # 2 steps: the fused kernels run under the (slow) interpreter
    settings = TextSettings(preset="tiny", context=16, batch=16)
    runs = [train_kernels(windows, kernels, settings, torch.device("cpu")) for kernels in ("torch", "fastlm")]
    assert runs[0]["steps"] == runs[1]["steps"] == 2
    # same start, same batches: the curves differ only by rounding
    torch.testing.assert_close(runs[1]["losses"], runs[0]["losses"], rtol=1e-4, atol=1e-4)
    assert runs[1]["held_out_loss"] == pytest.approx(runs[0]["held_out_loss"], rel=1e-4)


def test_training_learns_the_corpus():
    windows = split_windows(load_corpus(CORPUS), context=32)
    run = train_kernels(windows, "torch", TextSettings(preset="tiny", context=32, batch=16, epochs=3, lr=3e-3),
                        torch.device("cpu"))  # fmt: skip
    assert run["losses"][-1] < 0.7 * run["losses"][0]  # from 5.5 nats (uniform over 256 bytes)
    assert run["steps"] == 3 * -(-windows[0].shape[0] // 16) and run["tokens_per_s"] > 0


def test_command(tmp_path, capsys):
    assert main(["train", "lm", "--data", str(CORPUS), "--context", "32", "--kernels", "torch",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "held-out loss" in out and "torch kernels, step 1/" in out  # a plain progress line per step, piped
    assert (tmp_path / "reports" / "text_training.png").stat().st_size > 0
    assert (tmp_path / "results" / "text_training.jsonl").exists()
    with pytest.raises(SystemExit):
        main(["train", "lm", "--data", str(tmp_path / "missing.txt")])
    assert "argument --data: no such file" in capsys.readouterr().err


def test_compiled_training_matches_eager():
    train, held_out = split_windows(load_corpus(CORPUS), context=16)
    windows = (train[:24], held_out[:2])  # batches of 16 and 8: both shapes are compiled in the warm-up
    runs = [train_kernels(windows, "torch", TextSettings(preset="tiny", context=16, batch=16, compile=mode),
                          torch.device("cpu")) for mode in ("eager", "compile")]  # fmt: skip
    assert runs[1]["steps"] == 2
    torch.testing.assert_close(runs[1]["losses"], runs[0]["losses"], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_training_matches_eager():
    # reduce-overhead replays CUDA graphs whose outputs (losses, gradients) die at the next step:
    # the warm-up and the epoch must not carry one across, or the losses drift or the run fails
    train, held_out = split_windows(load_corpus(CORPUS), context=16)
    windows = (train[:56], held_out[:2])  # 3 full batches and a short one, in a shuffled order
    runs = [train_kernels(windows, "torch", TextSettings(preset="tiny", context=16, batch=16, compile=mode),
                          torch.device("cuda")) for mode in ("eager", "cudagraphs")]  # fmt: skip
    assert runs[1]["steps"] == 4
    torch.testing.assert_close(runs[1]["losses"], runs[0]["losses"], rtol=1e-3, atol=1e-3)
    assert runs[1]["held_out_loss"] == pytest.approx(runs[0]["held_out_loss"], rel=1e-3)
