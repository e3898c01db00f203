"""Tokenizers users bring, all without a network: a byte-level BPE trained on the input and saved with
the data, a Hugging Face tokenizer.json, and one-line errors for gpt2 whose tables cannot be fetched
and for tokenizers that cannot mark a document boundary."""

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fastlm.data import prepare as prepare_module
from fastlm.data.manifest import MANIFEST
from fastlm.data.prepare import prepare
from fastlm.data.tokenizer import load_tokenizer
from fastlm.data.tokens import TokenData

tokenizers = pytest.importorskip("tokenizers")

CORPUS = Path(__file__).parent / "corpus.txt"


def _stream(directory) -> np.ndarray:
    data = TokenData(directory)
    return np.concatenate([*data.split("train"), *data.split("val")])


def _documents(stream: np.ndarray, eot: int) -> list[np.ndarray]:
    """The token ids of each document: the stream cut at its boundary ids."""
    starts = np.flatnonzero(stream == eot)
    assert starts[0] == 0
    return [stream[a + 1 : b] for a, b in zip(starts, [*starts[1:], len(stream)], strict=True)]


def _prepare_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fastlm data prepare")
    prepare_module.add_arguments(parser)
    return prepare_module.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory) -> Path:
    """The corpus and a second document that spells the boundary token, with a BPE of 400 ids."""
    inputs = tmp_path_factory.mktemp("inputs")
    (inputs / "a.txt").write_text(CORPUS.read_text())
    (inputs / "b.txt").write_text("text that spells <|endoftext|> in the middle\n")
    out = tmp_path_factory.mktemp("bpe")
    prepare([inputs], out, "bpe:400", held_out=0.05, shard_tokens=10**8)
    return out


def test_bpe_is_trained_on_the_input_and_saved_with_the_data(bpe_data):
    manifest = json.loads((bpe_data / MANIFEST).read_text())
    assert manifest["tokenizer"] == "bpe:400" and manifest["vocab_size"] == 400 and manifest["dtype"] == "<u2"
    saved = tokenizers.Tokenizer.from_file(str(bpe_data / manifest["tokenizer_file"]))
    assert manifest["eot"] == saved.token_to_id("<|endoftext|>") == 0
    texts = [CORPUS.read_text(), "text that spells <|endoftext|> in the middle\n"]
    documents = _documents(_stream(bpe_data), manifest["eot"])
    assert [saved.decode(d.tolist()) for d in documents] == texts  # byte-level: every text decodes back
    assert len(documents[0]) < 0.6 * len(texts[0].encode())  # merges: fewer ids than bytes
    assert manifest["eot"] not in documents[1]  # the spelled token is text, not a boundary


def test_a_tokenizer_json_gives_the_ids_it_defines(bpe_data, tmp_path, capsys):
    manifest = json.loads((bpe_data / MANIFEST).read_text())
    path = bpe_data / manifest["tokenizer_file"]
    out = tmp_path / "out"
    assert _prepare_command(["--input", str(CORPUS), "--out", str(out), "--tokenizer", str(path)]) == 0
    mine = json.loads((out / MANIFEST).read_text())
    assert mine["tokenizer"].startswith("hf:") and mine["vocab_size"] == 400
    assert (out / mine["tokenizer_file"]).read_text() == path.read_text()  # the data carries its tokenizer
    np.testing.assert_array_equal(_documents(_stream(out), mine["eot"])[0], _documents(_stream(bpe_data), 0)[0])
    capsys.readouterr()
    assert _prepare_command(["--input", str(CORPUS), "--out", str(out), "--tokenizer", str(path)]) == 0
    assert "is ready" in capsys.readouterr().out  # the file's sha256 is the tokenizer's identity


def test_a_tokenizer_without_an_end_of_text_token_is_refused(tmp_path, capsys):
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator([CORPUS.read_text()], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    argv = ["--input", str(CORPUS), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert _prepare_command(argv) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and "holds none of the end-of-text tokens <|endoftext|>" in error
    (tmp_path / "broken.json").write_text("{")
    assert _prepare_command([*argv[:-1], str(tmp_path / "broken.json")]) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and "broken.json is not a tokenizers file" in error


def test_gpt2_offline_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    def get_encoding(name):  # what tiktoken raises when it cannot download its tables
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'\n(more lines)")

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=get_encoding))
    assert _prepare_command(["--input", str(CORPUS), "--out", str(tmp_path), "--tokenizer", "gpt2"]) == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1
    assert error.startswith("fastlm data prepare: error: --tokenizer gpt2: tiktoken cannot load GPT-2's tables")
    assert "Failed to resolve 'openaipublic.blob.core.windows.net'; use bytes, bpe:VOCAB or a tokenizer.json" in error


def test_without_the_tokenizers_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(ValueError, match=r'needs the tokenizers package \(pip install "fastlm\[tokenizers\]"\)$'):
        load_tokenizer("bpe:300")
