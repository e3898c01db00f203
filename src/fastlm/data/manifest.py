"""The manifest of prepared token data, and the checks of its shards against it.

`fastlm data prepare` records every shard's size (its token count), the sha256 of its bytes, and a
sample sha256: the sha256 of SAMPLE_BLOCKS blocks of SAMPLE_BYTES bytes spread evenly over the file
(the whole file when it is smaller). Opening the data (`fastlm train`) checks the size and the
sample, a few reads per shard whatever its size: a shard cut short, grown, replaced or damaged
inside a sampled block is refused before training starts. `fastlm data verify` reads every byte
and compares the full sha256. A change outside the sampled blocks is found there, or, when it puts
a token id outside the vocabulary, by the check of every batch training reads (`tokens.Windows`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fastlm.utils.errors import UserError

FORMAT = "fastlm-tokens"
VERSION = 2  # 2: shards carry sha256 and sample_sha256
MANIFEST = "manifest.json"
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096
_READ_CHUNK = 16 << 20


class DataError(UserError):
    """Input that cannot be prepared or data that cannot be read; one sentence naming the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_manifest(directory: Path, any_version: bool = False) -> dict | None:
    """The manifest of prepared data in ``directory``; None when there is none. DataError for a
    file that is not one, or (unless ``any_version``) one that another version of fastlm wrote."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise DataError(f"{path} cannot be read: {error}") from None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT):
        raise DataError(f"{path} is not a manifest of fastlm token data (format {FORMAT})")
    if not any_version and manifest.get("version") != VERSION:
        raise DataError(
            f"{path} was written by another version of fastlm data prepare (version "
            f"{manifest.get('version')}, this one reads {VERSION}): prepare the data again"
        )
    return manifest


def sample_sha256(path: Path) -> str:
    """The sha256 of the file's sampled blocks (see the module's docstring)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for index in range(SAMPLE_BLOCKS):
                f.seek(index * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def file_sha256(path: Path, advance: Callable[[int], None] = lambda _: None) -> str:
    """The sha256 of every byte of the file; ``advance(bytes)`` after each chunk read."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


def shard_bytes(manifest: dict, shard: dict) -> int:
    return shard["tokens"] * np.dtype(manifest["dtype"]).itemsize


def check_shard(directory: Path, manifest: dict, shard: dict) -> None:
    """The cheap check on open: DataError unless the shard has its size and sample sha256."""
    path = Path(directory) / shard["file"]
    expected = shard_bytes(manifest, shard)
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        state = "missing" if size is None else f"{size:,} bytes, {expected:,} expected"
        raise DataError(f"{path} is {state}: prepare the data again")
    if sample_sha256(path) != shard["sample_sha256"]:
        raise DataError(
            f"{path} changed after it was prepared (a sampled block differs from the manifest's): "
            "prepare the data again"
        )


def verify(directory: Path, manifest: dict, advance: Callable[[int], None] = lambda _: None) -> list[str]:
    """Every shard's size and full sha256 against ``manifest``: one sentence per damaged shard, []
    when all match. ``advance(bytes)`` reports progress."""
    directory = Path(directory)
    problems = []
    for shard in manifest["shards"]:
        path, expected = directory / shard["file"], shard_bytes(manifest, shard)
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            problems.append(f"{path} is " + ("missing" if size is None else f"{size:,} bytes, {expected:,} expected"))
            advance(expected)
        elif file_sha256(path, advance) != shard["sha256"]:
            problems.append(f"{path} is corrupt: its sha256 differs from the manifest's")
    return problems
