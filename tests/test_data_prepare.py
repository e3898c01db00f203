"""`fastlm data prepare` and reading its output: the token stream, shards and splits, idempotence,
one-line errors for input that is not text, shards checked against the manifest (a sample on open,
every byte by `fastlm data verify`), and the windows and epochs training draws from."""

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fastlm.data import prepare as prepare_module
from fastlm.data import verify as verify_module
from fastlm.data.documents import cu_seqlens
from fastlm.data.manifest import MANIFEST, SAMPLE_BLOCKS, SAMPLE_BYTES, DataError, sample_sha256
from fastlm.data.prepare import _pieces, prepare
from fastlm.data.tokenizer import load_tokenizer
from fastlm.data.tokens import EpochOrder, TokenData, Windows

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
HAS_TIKTOKEN = importlib.util.find_spec("tiktoken") is not None


def _stream(directory) -> np.ndarray:
    data = TokenData(directory)
    return np.concatenate([*data.split("train"), *data.split("val")])


def _prepare_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fastlm data prepare")
    prepare_module.add_arguments(parser)
    return prepare_module.run(parser.parse_args(argv))


def test_bytes_stream_is_each_document_after_the_boundary_id(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("second")
    (docs / "a.txt").write_text("first é")
    (docs / "sub" / "c.txt").write_text("third")
    (docs / ".hidden").write_text("skipped")
    (docs / "empty.txt").write_text("")
    manifest = prepare([docs], tmp_path / "out", "bytes", held_out=0.25, shard_tokens=7)
    expected = [t for text in ("first é", "second", "third") for t in [256, *text.encode()]]  # folders sorted
    np.testing.assert_array_equal(_stream(tmp_path / "out"), expected)
    assert (manifest["documents"], manifest["tokens"], manifest["vocab_size"]) == (3, len(expected), 257)
    assert "separator" not in manifest["settings"]  # as data prepared before --separator records it: still ready
    assert len(manifest["shards"]) == -(-len(expected) // 7) and manifest["dtype"] == "<u2"
    held = sum(r["stop"] - r["start"] for r in manifest["splits"]["val"])
    assert held == int(0.25 * len(expected))  # the tail, across shard boundaries


def test_a_separator_makes_each_record_a_document_and_training_sees_their_boundaries(tmp_path):
    """--separator: records between it are documents (empty ones carry none); the windows' boundary
    ids give `cu_seqlens` exactly those documents' starts."""
    (tmp_path / "many.txt").write_text("ab<|endoftext|>cde<|endoftext|><|endoftext|>fghi<|endoftext|>")
    assert (
        _prepare_command(
            [
                "--input",
                str(tmp_path / "many.txt"),
                "--out",
                str(tmp_path / "out"),
                "--tokenizer",
                "bytes",
                "--separator",
                "<|endoftext|>",
                "--held-out",
                "0.2",
            ]
        )
        == 0
    )
    data = TokenData(tmp_path / "out")
    expected = [t for text in ("ab", "cde", "fghi") for t in [256, *text.encode()]]
    np.testing.assert_array_equal(_stream(tmp_path / "out"), expected)
    assert data.manifest["documents"] == 3 and data.boundary == 256
    assert data.manifest["settings"]["separator"] == "<|endoftext|>"
    row = np.array(expected[:8])[None]  # documents ab and cde, and the start of fghi
    assert cu_seqlens(row, data.boundary)[:4].tolist() == [0, 3, 7, 8]


def test_separator_escapes_and_empty_value():
    assert prepare_module.separator_text(r"\n\n\n") == "\n\n\n"
    assert prepare_module.separator_text(r"a\tb\\n") == "a\tb\\n"
    with pytest.raises(argparse.ArgumentTypeError, match="non-empty"):
        prepare_module.separator_text("")


def test_prepare_is_idempotent_and_replaces_stale_shards(tmp_path, capsys):
    out = tmp_path / "out"
    first = prepare([CORPUS], out, "bytes", held_out=0.05, shard_tokens=3000)
    shards = sorted(p.name for p in out.glob("*.bin"))
    mtimes = [p.stat().st_mtime_ns for p in sorted(out.glob("*"))]
    capsys.readouterr()
    assert prepare([CORPUS], out, "bytes", held_out=0.05, shard_tokens=3000) == first
    assert "is ready" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in sorted(out.glob("*"))] == mtimes
    second = prepare([CORPUS], out, "bytes", held_out=0.1, shard_tokens=3000)  # other settings: new shards
    assert sorted(p.name for p in out.glob("*.bin")) == [s["file"] for s in second["shards"]]
    assert not set(shards) & {s["file"] for s in second["shards"]}
    assert second["sha256"] == first["sha256"] and second["splits"] != first["splits"]
    np.testing.assert_array_equal(_stream(out)[1:9], np.frombuffer(CORPUS.read_bytes()[:8], np.uint8))


BAD_INPUTS = {
    "all empty": (lambda d: (d / "a.txt").write_text(""), "holds no text: 1 file(s), all empty"),
    "binary": (lambda d: (d / "a.bin").write_bytes(b"PK\x03\x04\x00\x00"), "is not text: it holds NUL bytes"),
    "not UTF-8": (lambda d: (d / "a.txt").write_bytes("Gr\xf6\xdfe".encode("latin-1")), "is not UTF-8 text (byte 2"),
    "empty folder": (lambda d: None, "holds no files"),
    "the --out folder": (lambda d: (d / "a.txt").write_text("text"), "lies in --out"),
    "prepared data in it": (
        lambda d: prepare([CORPUS], d / "docs", "bytes", held_out=0.1, shard_tokens=3000),
        "docs holds prepared token data (manifest.json); train on it with --data",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_unusable_input_is_a_one_line_error(case, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    make, message = BAD_INPUTS[case]
    make(folder)
    out = folder if case == "the --out folder" else tmp_path / "new" / "out"
    assert _prepare_command(["--input", str(folder), "--out", str(out), "--tokenizer", "bytes"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fastlm data prepare: error: ") and message in error and len(error.splitlines()) == 1
    assert not (out / MANIFEST).exists()
    assert out == folder or not (tmp_path / "new").exists()  # a failed run leaves no folder and no shard behind


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "missing.txt"], "--input missing.txt does not exist"),
        (["--input", str(CORPUS), "--held-out", "0"], "--held-out must be above 0"),
        (["--input", str(CORPUS), "--held-out", "0.0001"], "leaves 0 held-out tokens"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _prepare_command([*argv, "--out", "out", "--tokenizer", "bytes"]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_failed_prepare_keeps_the_data_prepared_before(tmp_path, capsys):
    out = tmp_path / "out"
    first = prepare([CORPUS], out, "bytes", held_out=0.05, shard_tokens=3000)
    files = sorted(p.name for p in out.iterdir())
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too little")
    with pytest.raises(DataError, match="held-out tokens"):
        prepare([tiny], out, "bytes", held_out=0.05, shard_tokens=3000)
    assert sorted(p.name for p in out.iterdir()) == files and TokenData(out).manifest == first


@pytest.mark.skipif(HAS_TIKTOKEN, reason="tiktoken is installed")
def test_gpt2_without_tiktoken_says_so():
    with pytest.raises(ValueError, match="needs tiktoken"):
        load_tokenizer("gpt2")


@pytest.mark.skipif(not HAS_TIKTOKEN, reason="tiktoken is not installed")
def test_gpt2_pieces_tokenize_like_the_whole_document(tmp_path, monkeypatch):
    import tiktoken

    text = CORPUS.read_text() * 3
    monkeypatch.setattr(prepare_module, "_PIECE_CHARS", 100)  # many cuts
    manifest = prepare([CORPUS, CORPUS, CORPUS], tmp_path, "gpt2", held_out=0.05, shard_tokens=10**8)
    encoding = tiktoken.get_encoding("gpt2")
    whole = [t for _ in range(3) for t in [encoding.eot_token, *encoding.encode_ordinary(text[: len(text) // 3])]]
    np.testing.assert_array_equal(_stream(tmp_path), whole)
    assert manifest["vocab_size"] == 50257


def test_pieces_cut_before_a_line_that_starts_with_text(monkeypatch):
    monkeypatch.setattr(prepare_module, "_PIECE_CHARS", 10)
    text = "one two three\n  indented\nnext line here\n\nlast"
    pieces = list(_pieces(text))
    assert "".join(pieces) == text and len(pieces) == 3
    assert all(piece.endswith("\n") for piece in pieces[:-1])
    assert [p[0] for p in pieces[1:]] == ["n", "l"]  # never before whitespace


def test_damaged_data_is_a_one_line_error(tmp_path):
    prepare([CORPUS], tmp_path, "bytes", held_out=0.05, shard_tokens=10**8)
    shard = next(tmp_path.glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="prepare the data again"):
        TokenData(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="is not a manifest of fastlm token data"):
        TokenData(tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(DataError, match="holds no prepared data"):
        TokenData(tmp_path)
    with pytest.raises(DataError, match="is not a folder of prepared data"):
        TokenData(tmp_path / "missing")


def test_windows_cover_every_range_and_share_one_token():
    ranges = [np.arange(0, 10), np.arange(100, 103), np.arange(200, 207)]  # 3, 0 and 2 windows of 3 + 1
    windows = Windows(ranges, context=3, vocab_size=207)
    assert windows.count == 5
    np.testing.assert_array_equal(
        windows[np.array([0, 2, 3, 4])], [[0, 1, 2, 3], [6, 7, 8, 9], [200, 201, 202, 203], [203, 204, 205, 206]]
    )
    for vocab_size in (206, 200):  # the last id read, then the first one, just outside the vocabulary
        with pytest.raises(DataError, match=f"the data holds token id {vocab_size}, outside its vocabulary"):
            Windows(ranges, context=3, vocab_size=vocab_size)[np.array([3, 4])]
    Windows(ranges, context=3, vocab_size=200)[np.array([0, 2])]  # windows of ids below 200 read as before


def test_epochs_are_seeded_permutations():
    order = EpochOrder(count=7, seed=3)
    ids = order.ids(0, 21)
    for epoch in range(3):
        assert sorted(ids[7 * epoch : 7 * (epoch + 1)]) == list(range(7))
    assert not np.array_equal(ids[:7], ids[7:14])
    np.testing.assert_array_equal(EpochOrder(7, 3).ids(5, 10), ids[5:15])  # any position, from any state
    assert not np.array_equal(EpochOrder(7, 4).ids(0, 7), ids[:7])


def _verify_command(directory) -> int:
    parser = argparse.ArgumentParser(prog="fastlm data verify")
    verify_module.add_arguments(parser)
    return verify_module.run(parser.parse_args([str(directory)]))


def _damage(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(data)


def test_shards_are_checked_against_the_manifest(tmp_path, capsys, monkeypatch):
    # shards larger than the sample (16 blocks of 4 KiB): a change in a sampled block is found on
    # open, one between the blocks only by `fastlm data verify`, which reads every byte
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 4000)  # 380 kB: shards of 100,000 ids (200 kB)
    prepare([text], tmp_path / "data", "bytes", held_out=0.05, shard_tokens=100_000)
    shards = sorted((tmp_path / "data").glob("*.bin"))
    assert len(shards) == 4 and shards[0].stat().st_size > SAMPLE_BLOCKS * SAMPLE_BYTES
    TokenData(tmp_path / "data")
    capsys.readouterr()
    assert _verify_command(tmp_path / "data") == 0
    assert "4 shard(s), 380,001 tokens, every sha256 matches the manifest" in capsys.readouterr().out
    between_blocks = SAMPLE_BYTES + 10  # block 0 is bytes [0, 4096), block 1 starts near 13,000
    _damage(shards[1], between_blocks)
    assert (
        sample_sha256(shards[1]) == json.loads((tmp_path / "data" / MANIFEST).read_text())["shards"][1]["sample_sha256"]
    )
    TokenData(tmp_path / "data")  # the sample does not see it
    _damage(shards[2], 0)
    with pytest.raises(DataError, match=f"{shards[2].name} changed after it was prepared"):
        TokenData(tmp_path / "data")
    assert _verify_command(tmp_path / "data") == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{shards[1]} is corrupt: its sha256 differs from the manifest's",
        f"{shards[2]} is corrupt: its sha256 differs from the manifest's",
        "2 of 4 shard(s) damaged: prepare the data again",
    ]


def test_data_of_an_older_version_is_refused_and_prepared_again(tmp_path, capsys):
    prepare([CORPUS], tmp_path, "bytes", held_out=0.05, shard_tokens=10**8)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "version": 1}))
    with pytest.raises(DataError, match="written by another version of fastlm data prepare .version 1"):
        TokenData(tmp_path)
    capsys.readouterr()
    assert prepare([CORPUS], tmp_path, "bytes", held_out=0.05, shard_tokens=10**8)["version"] == manifest["version"]
    assert "wrote" in capsys.readouterr().out  # not "is ready": the shards were written again
    TokenData(tmp_path)
