"""`fastlm data prepare`: tokenize text once into memory-mapped token shards for `fastlm train`.

Also `python -m fastlm.data prepare`:

    fastlm data prepare --input books/ notes.txt --tokenizer bpe:16384 --out data/books

    data/books/
      manifest.json                   tokenizer, vocabulary, dtype, counts, inputs, shards (size,
                                      sha256, sample sha256: `fastlm.data.manifest`), splits (below)
      tokenizer-3f9a1c2b7d4e.json     the tokenizer (a trained bpe:VOCAB or the tokenizer.json given);
                                      none for bytes and gpt2
      tokens-3f9a1c2b7d4e-00000.bin   token ids as raw little-endian uint16 (uint32 for vocabularies
      tokens-3f9a1c2b7d4e-00001.bin   past 65536), --shard-tokens per file; np.memmap reads them

Documents are the input files (folders are walked in sorted order, hidden files and --out skipped;
empty files carry no document), or with --separator TEXT the records between TEXT in each file (a
JSONL-free way to keep many short documents in one file; empty records carry none). Each document is
written after the tokenizer's boundary id and the id appears nowhere else, so the boundaries need
no file of their own: `fastlm train` attends within each document from them
(`fastlm.data.documents`). The held-out split is the last --held-out fraction of the
token stream; the manifest names each split as token ranges of the shard files, so splitting copies
nothing.

Idempotent: the manifest records the inputs (path, size, modification time) and the settings
(a tokenizer file by its sha256); run again with the same ones, the command only says the data is
ready, before loading or training a tokenizer. Otherwise new files are written (their names carry a
tag of the inputs and settings, so they never replace the committed ones), the manifest is replaced
in one rename, and only then are the files it no longer names removed: a run stopped at any moment
leaves the previous data whole.

Cost: the inputs are read once (twice for bpe:VOCAB, whose training reads them first); a document
is held in memory whole. bytes, gpt2 and bpe:VOCAB tokenize it in pieces of about 1 MB cut before a
line that starts with a non-space character, a place where GPT-2's pre-tokenizer always splits, so
the ids equal those of the document tokenized at once; a tokenizer.json (whose pre-tokenizer may
treat the start of its input apart) gets each document whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fastlm.data.manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    DataError,
    check_shard,
    read_manifest,
    sample_sha256,
    token_dtype,
)
from fastlm.data.tokenizer import (
    BPE_PREFIX,
    Tokenizer,
    default_tokenizer,
    load_tokenizer,
    tokenizer_name,
    tokenizer_spec,
)
from fastlm.utils.paths import check_writable_folder
from fastlm.utils.progress import progress

_DATA_FILE = re.compile(r"(tokens-[0-9a-f]{12}-\d{5}\.bin|tokenizer-[0-9a-f]{12}\.json)(\.tmp)?")
_PIECE_CHARS = 1 << 20
_PIECE_END = re.compile(r"\n(?=\S)")


def separator_text(text: str) -> str:
    """--separator's value: the text with \\n, \\t and \\\\ read as newline, tab and backslash; not empty."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty separator")
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def input_files(inputs: list[Path], out: Path) -> list[Path]:
    """The files named or found below the folders named, in order; DataError for a missing path."""
    files = []
    for path in inputs:
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = [p for p in sorted(path.rglob("*")) if p.is_file() and not _hidden_or_output(p, path, out)]
            prepared = next((p.parent for p in found if p.name == MANIFEST), None)
            if prepared is not None:  # its token shards are no text
                raise DataError(
                    f"--input {path}: {prepared} holds prepared token data ({MANIFEST}); train on it with "
                    f"--data {prepared}, or leave it out of --input"
                )
            if not found and (path.resolve() == out.resolve() or out.resolve() in path.resolve().parents):
                raise DataError(f"--input {path} lies in --out {out}, whose files are never read; use another --out")
            if not found:
                raise DataError(f"--input {path} holds no files")
            files += found
        else:
            raise DataError(f"--input {path} does not exist")
    return files


def _hidden_or_output(path: Path, root: Path, out: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts) or out.resolve() in path.resolve().parents


def read_document(path: Path) -> str:
    """The file's text; DataError when it is binary or not UTF-8."""
    data = path.read_bytes()
    if b"\0" in data:
        raise DataError(f"{path} is not text: it holds NUL bytes (a binary file?)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def _pieces(text: str) -> Iterator[str]:
    """``text`` in pieces of about _PIECE_CHARS characters, each ending at a line break followed by
    a non-space character (or at the end)."""
    start = 0
    while start < len(text):
        cut = _PIECE_END.search(text, start + _PIECE_CHARS)
        stop = cut.end() if cut else len(text)
        yield text[start:stop]
        start = stop


class _ShardWriter:
    """Appends token ids to numbered shard files of at most ``shard_tokens`` ids, hashing the stream
    and each shard."""

    def __init__(self, out: Path, tag: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.tag, self.shard_tokens = out, tag, shard_tokens
        self.dtype = dtype.newbyteorder("<")
        # {"file", "tokens", "sha256", "sample_sha256"} of every shard written so far (the hashes once closed)
        self.shards: list[dict] = []
        self.sha256 = hashlib.sha256()
        self._file, self._shard_sha256 = None, None

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, tokens = tokens[:room], tokens[room:]
            data = part.tobytes()
            self._file.write(data)
            self.sha256.update(data)
            self._shard_sha256.update(data)
            self.shards[-1]["tokens"] += len(part)

    def _next_shard(self) -> None:
        self.close()
        name = f"tokens-{self.tag}-{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0})
        self._file, self._shard_sha256 = (self.out / f"{name}.tmp").open("wb"), hashlib.sha256()

    def close(self) -> None:
        """Finish the open shard: a complete file under its final name, its hashes recorded."""
        if self._file is not None:
            self._file.close()
            shard = self.shards[-1]
            os.replace(self.out / f"{shard['file']}.tmp", self.out / shard["file"])
            shard["sha256"] = self._shard_sha256.hexdigest()
            shard["sample_sha256"] = sample_sha256(self.out / shard["file"])
            self._file = None


def _split_ranges(shards: list[dict], start: int, stop: int) -> list[dict]:
    """Tokens [start, stop) of the stream as {"file", "start", "stop"} ranges of the shards."""
    ranges, offset = [], 0
    for shard in shards:
        low, high = max(start, offset), min(stop, offset + shard["tokens"])
        if low < high:
            ranges.append({"file": shard["file"], "start": low - offset, "stop": high - offset})
        offset += shard["tokens"]
    return ranges


def _ready(directory: Path, manifest: dict | None, sources: list[dict], settings: dict) -> bool:
    """Whether ``manifest`` (any version) describes these inputs and settings, with intact shards."""
    if manifest is None or manifest.get("version") != VERSION:
        return False
    if manifest["inputs"] != sources or manifest["settings"] != settings:
        return False
    try:
        for shard in manifest["shards"]:
            check_shard(directory, manifest, shard)
    except DataError:
        return False
    return True


def prepare(
    inputs: list[Path], out: Path, tokenizer: str, held_out: float, shard_tokens: int, separator: str | None = None
) -> dict:
    """Tokenize ``inputs`` into ``out`` with the tokenizer of spec ``tokenizer`` (see the module's
    docstring); returns the manifest. Prints progress; raises DataError (or ValueError for the
    tokenizer) for input it cannot use."""
    out = Path(out)
    try:
        check_writable_folder(out)
    except ValueError as error:
        raise DataError(f"--out {error}") from None
    files = input_files(inputs, out)
    sources = [{"path": str(f.resolve()), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    settings = {"tokenizer": tokenizer_name(tokenizer), "held_out": held_out, "shard_tokens": shard_tokens}
    if separator is not None:  # recorded only when given: data prepared before --separator stays ready
        settings["separator"] = separator
    existing = read_manifest(out, any_version=True) if out.is_dir() else None
    if _ready(out, existing, sources, settings):
        print(
            f"{out} is ready: {existing['tokens']:,} tokens, {existing['documents']} document(s) "
            f"(prepared before from the same inputs and settings)",
            flush=True,
        )
        return existing
    if tokenizer.startswith(BPE_PREFIX):
        print(f"training the {tokenizer} tokenizer on {len(files)} file(s)", flush=True)
    tokenizer = load_tokenizer(tokenizer, lambda: (read_document(f) for f in files))
    tag = hashlib.sha256(json.dumps([sources, settings]).encode()).hexdigest()[:12]
    made = [p for p in (out, *out.parents) if not p.exists()]  # the folders this run creates, deepest first
    out.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(out, tag, token_dtype(tokenizer.vocab_size), shard_tokens)
    tokenizer_file = f"tokenizer-{tag}.json" if tokenizer.json is not None else None
    try:
        manifest = _write(out, files, tokenizer, tokenizer_file, writer, separator, held_out, sources, settings)
        temporary = out / f"{MANIFEST}.tmp"
        temporary.write_text(json.dumps(manifest, indent=1))
    except BaseException:  # an error or Ctrl-C: this run's files go, the files of the manifest in force stay
        writer.close()
        kept = _named_files(existing)
        for name in filter(None, [*(shard["file"] for shard in writer.shards), tokenizer_file]):
            (out / f"{name}.tmp").unlink(missing_ok=True)
            if name not in kept:
                (out / name).unlink(missing_ok=True)
        (out / f"{MANIFEST}.tmp").unlink(missing_ok=True)
        for folder in made:
            if not any(folder.iterdir()):
                folder.rmdir()
        raise
    os.replace(temporary, out / MANIFEST)  # the commit
    named = _named_files(manifest)
    for path in out.iterdir():
        if _DATA_FILE.fullmatch(path.name) and path.name not in named:
            path.unlink()
    held = sum(r["stop"] - r["start"] for r in manifest["splits"]["val"])
    print(
        f"wrote {out}: {manifest['tokens']:,} tokens ({manifest['tokens'] - held:,} train, {held:,} held out), "
        f"{manifest['documents']} document(s), {tokenizer.name} tokenizer (vocabulary {tokenizer.vocab_size:,})",
        flush=True,
    )
    return manifest


def _named_files(manifest: dict | None) -> set[str]:
    """The shard and tokenizer files a manifest names (none without one)."""
    if manifest is None:
        return set()
    return {shard["file"] for shard in manifest.get("shards", [])} | {manifest.get("tokenizer_file")} - {None}


def _write(
    out: Path,
    files: list[Path],
    tokenizer: Tokenizer,
    tokenizer_file: str | None,
    writer: _ShardWriter,
    separator: str | None,
    held_out: float,
    sources: list[dict],
    settings: dict,
) -> dict:
    """The tokenizer's file and the shards of ``files`` in ``out``, and the manifest that names
    them (not written yet); DataError for text that cannot make a run's data."""
    if tokenizer_file is not None:
        (out / f"{tokenizer_file}.tmp").write_text(tokenizer.json)
        os.replace(out / f"{tokenizer_file}.tmp", out / tokenizer_file)
    try:
        documents = _tokenize(files, tokenizer, writer, separator)
    finally:
        writer.close()
    total = sum(shard["tokens"] for shard in writer.shards)
    if documents == 0:
        raise DataError(f"--input holds no text: {len(files)} file(s), all empty")
    held = int(total * held_out)
    if held < 2:
        raise DataError(
            f"--held-out {held_out} of {total:,} tokens leaves {held} held-out tokens; use more text "
            "or a larger --held-out"
        )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot": tokenizer.eot,
        "tokenizer_file": tokenizer_file,
        "dtype": writer.dtype.str,
        "tokens": total,
        "documents": documents,
        "sha256": writer.sha256.hexdigest(),
        "settings": settings,
        "inputs": sources,
        "shards": writer.shards,
        "splits": {
            "train": _split_ranges(writer.shards, 0, total - held),
            "val": _split_ranges(writer.shards, total - held, total),
        },
    }
    return manifest


def _tokenize(files: list[Path], tokenizer: Tokenizer, writer: _ShardWriter, separator: str | None) -> int:
    """Write every non-empty file (or record between ``separator``) as a document; returns how many
    there were."""
    documents = 0
    total_bytes = sum(f.stat().st_size for f in files)
    with progress("tokenizing", total=total_bytes) as bar:
        for index, path in enumerate(files, 1):
            text = read_document(path)
            for record in text.split(separator) if separator else [text]:
                if not record:
                    continue
                documents += 1
                writer.write(np.array([tokenizer.eot]))
                for piece in [record] if tokenizer.whole_documents else _pieces(record):
                    writer.write(tokenizer.encode(piece))
                    bar.advance(len(piece.encode("utf-8")))
            if len(files) > 1:
                bar.note(f"tokenized {index}/{len(files)} files: {path}")
    return documents


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fastlm data prepare`; `run` carries them out."""
    p.add_argument(
        "--input",
        type=Path,
        nargs="+",
        required=True,
        metavar="PATH",
        help="text files, and folders whose files are all taken (required)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the shards (required)")
    p.add_argument(
        "--tokenizer",
        type=tokenizer_spec,
        default=None,
        metavar="SPEC",
        help="bytes (vocabulary 257), gpt2 (tiktoken's BPE, vocabulary 50257; its tables are downloaded "
        "on first use), PATH to a Hugging Face tokenizer.json, or bpe:VOCAB (a byte-level BPE of VOCAB "
        "ids trained on the input, offline) (default: gpt2 where tiktoken is installed, else "
        "bytes)",
    )
    p.add_argument(
        "--separator",
        type=separator_text,
        default=None,
        metavar="TEXT",
        help="one document per record between TEXT in each file, e.g. '<|endoftext|>' or '\\n\\n\\n' "
        "(\\n, \\t and \\\\ are read as newline, tab and backslash) (default: one document per file)",
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="fraction of the tokens, taken from the end, held out for evaluation (default: %(default)s)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="token ids per shard file (default: %(default)s)",
    )
    p.set_defaults(prog=p.prog)


def run(args: argparse.Namespace) -> int:
    """`fastlm data prepare`; 0, or 2 after a one-line error for input it cannot use."""
    tokenizer = args.tokenizer or default_tokenizer()
    try:
        if not 0 < args.held_out <= 0.5:
            raise DataError(f"--held-out must be above 0 and at most 0.5, got {args.held_out}")
        if args.shard_tokens < 1:
            raise DataError(f"--shard-tokens must be at least 1, got {args.shard_tokens}")
        prepare(args.input, args.out, tokenizer, args.held_out, args.shard_tokens, args.separator)
    except DataError as error:
        message = str(error)
    except ValueError as error:  # the tokenizer's
        message = f"--tokenizer {tokenizer}: {error}"
    except BrokenPipeError:  # stdout's reader went away: `fastlm`'s main ends quietly
        raise
    except OSError as error:
        message = f"{error.filename}: {error.strerror}" if error.filename else str(error)
    else:
        return 0
    print(f"{args.prog}: error: {message}", flush=True, file=sys.stderr)
    return 2
