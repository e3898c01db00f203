"""Training checkpoints that survive a process killed at any moment: a folder of numbered files and
a manifest that names the committed ones.

    runs/xl/
      manifest.json                     the committed checkpoints, oldest first: step, file, bytes, sha256, config
      step-00000200-3f9a1c2b7d4e.pt     the last `keep` checkpoints, each a torch.save archive of plain data
      step-00000300-81c0d5e6a2f4.pt     and tensors: {"format", "version", "step", "config", "state"}

`save` writes the new checkpoint to a temporary file in the folder, flushes it to disk, verifies it
(its size and sha256 read back against the bytes written), renames it to its numbered name (which
carries the start of its sha256, so it never replaces a file the manifest names), and only then
commits it by replacing the manifest (written to a temporary file, flushed, renamed). A process
killed at any point leaves a manifest that names complete, verified files: the checkpoints before
the save, or those plus the new one. The next save removes what no manifest names (an interrupted
save's files, checkpoints beyond the last `keep`).

`load` reads the newest committed checkpoint (or the one of a given step) with
`torch.load(weights_only=True)`, so a checkpoint never runs code, after checking its size and
sha256 against the manifest; given the configuration of the run that wants to continue, it refuses
a different one unless the differing fields are overridden. Every failure is a `CheckpointError`
whose message is one sentence naming the file and what is wrong: missing, truncated, corrupt
(checksum mismatch), not a fastlm checkpoint, written with a different configuration. A damaged
file (`DamagedCheckpointError`) also names the newest older checkpoint that is intact.

The contents are the caller's: `config` is JSON data describing the run (what must match to
continue it exactly), `state` is a dict of tensors and plain data (model and optimizer state dicts,
a data position, ...). One run writes to a folder at a time.

Fault-injection tests set FASTLM_CHECKPOINT_PAUSE_S: `save` then sleeps that many seconds between
its stages (file written, file renamed, manifest committed), so that a process killed at a random
moment often lands inside a save.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "fastlm-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
# what `save` writes: committed files (step, sha256 prefix) and the temporaries of a save in flight
_CHECKPOINT_NAME = re.compile(r"step-(\d{8,})-([0-9a-f]{12})\.pt")
_TEMPORARY_NAME = re.compile(r"(step-\d{8,}\.pt|manifest\.json)\.tmp")
_READ_CHUNK = 16 << 20


class CheckpointError(Exception):
    """A checkpoint cannot be written, read or used; the message is one sentence naming the file."""


class DamagedCheckpointError(CheckpointError):
    """The file of the checkpoint asked for is damaged; ``intact_step`` is the step of the newest
    older committed checkpoint whose file is intact (None when there is none)."""

    def __init__(self, message: str, intact_step: int | None) -> None:
        super().__init__(message)
        self.intact_step = intact_step


class ConfigMismatchError(CheckpointError):
    """The checkpoint was written by a run with another configuration; `fields` lists what differs."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True)
class Checkpoint:
    step: int
    config: dict
    state: dict


def config_differences(saved: dict, current: dict, override: Iterable[str] = ()) -> list[str]:
    """The fields, sorted, whose values differ between two configurations (a field only one has
    differs too), leaving out those in ``override``."""
    allowed = set(override)
    fields = (saved.keys() | current.keys()) - allowed
    return sorted(f for f in fields if f not in saved or f not in current or saved[f] != current[f])


def newest(directory: Path) -> dict | None:
    """The manifest entry of the newest committed checkpoint in ``directory`` ({"step", "file",
    "bytes", "sha256", "config"}), or None when it holds none (or does not exist)."""
    entries = _read_manifest(Path(directory))
    return entries[-1] if entries else None


def steps(directory: Path) -> list[int]:
    """The steps of the committed checkpoints in ``directory``, oldest first (none: empty)."""
    return [entry["step"] for entry in _read_manifest(Path(directory))]


def save(directory: Path, step: int, config: dict, state: dict, *, keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` into ``directory`` and commit it; returns its file.

    The manifest keeps the checkpoints of earlier steps up to ``keep`` in all (those of later steps,
    left by a run resumed from an older checkpoint, are dropped). Raises `CheckpointError` when the
    file cannot be written or fails verification; the committed checkpoints are then untouched."""
    directory = Path(directory)
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if json.loads(json.dumps(config)) != config:  # tuples would come back as lists and never compare equal
        raise ValueError("config must be JSON data (dicts, lists, strings, numbers, booleans, None)")
    earlier = [e for e in _read_manifest(directory) if e["step"] < step]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = directory / f"step-{step:08d}.pt.tmp"
        payload = {"format": FORMAT, "version": VERSION, "step": step, "config": config, "state": state}
        size, sha256 = _write(temporary, payload)
        _pause_for_fault_injection()
        _verify(temporary, size, sha256)
        path = directory / f"step-{step:08d}-{sha256[:12]}.pt"
        os.replace(temporary, path)
        _fsync_directory(directory)
        _pause_for_fault_injection()
        entry = {"step": step, "file": path.name, "bytes": size, "sha256": sha256, "config": config}
        entries = [*earlier, entry][-keep:]
        _write_manifest(directory, entries)
        _pause_for_fault_injection()
        _remove_unlisted(directory, entries)
    except OSError as error:
        raise CheckpointError(f"writing the checkpoint of step {step} into {directory} failed: {error}") from None
    return path


def load(
    directory: Path,
    config: dict | None = None,
    override: Iterable[str] = (),
    step: int | None = None,
    implied: dict | None = None,
) -> Checkpoint:
    """The newest committed checkpoint in ``directory`` (with ``step``, the one of that step),
    verified. With ``config``, raises `ConfigMismatchError` when the checkpoint's configuration
    differs in a field not in ``override``; `DamagedCheckpointError` when its file is damaged.
    ``implied``: fields that checkpoints of older versions do not record, with the value their
    behaviour had, compared as if recorded."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist: there is no checkpoint to resume")
    entries = _read_manifest(directory)
    if not entries:
        raise CheckpointError(f"{directory} holds no checkpoint (no {MANIFEST} with an entry)")
    entry = entries[-1] if step is None else next((e for e in entries if e["step"] == step), None)
    if entry is None:
        steps = ", ".join(str(e["step"]) for e in entries)
        raise CheckpointError(f"{directory} holds no checkpoint of step {step} (it holds steps {steps})")
    if config is not None:
        saved = {**(implied or {}), **entry["config"]}
        differences = config_differences(saved, config, override)
        if differences:
            changes = ", ".join(f"{f} {_shown(saved, f)} -> {_shown(config, f)}" for f in differences)
            message = f"{directory} holds a checkpoint of a run with another configuration ({changes})"
            raise ConfigMismatchError(message, differences)
    try:
        return _read(directory, entry)
    except CheckpointError as error:
        intact = [e["step"] for e in entries if e["step"] < entry["step"] and _intact(directory, e)]
        if intact:
            error = f"{error}; the older checkpoint of step {intact[-1]} is intact"
        raise DamagedCheckpointError(str(error), intact[-1] if intact else None) from None


def _read(directory: Path, entry: dict) -> Checkpoint:
    """The checkpoint of a manifest entry, its file checked against the entry."""
    path = directory / entry["file"]
    _check_file(path, entry["bytes"], entry["sha256"])
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} is not a fastlm checkpoint: it holds objects other than tensors and plain "
            "data, which would run code when loaded"
        ) from None
    except Exception as error:  # torch raises many types for unreadable archives; the message is what matters
        raise CheckpointError(f"{path} cannot be read as a checkpoint: {_first_line(error)}") from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT and payload.get("version") == VERSION):
        raise CheckpointError(f"{path} is not a fastlm checkpoint (format {FORMAT} version {VERSION})")
    if payload["step"] != entry["step"] or payload["config"] != entry["config"]:
        raise CheckpointError(f"{path} does not hold the step and configuration that {MANIFEST} records for it")
    return Checkpoint(step=payload["step"], config=payload["config"], state=payload["state"])


def _intact(directory: Path, entry: dict) -> bool:
    try:
        _check_file(directory / entry["file"], entry["bytes"], entry["sha256"])
    except CheckpointError:
        return False
    return True


def _read_manifest(directory: Path) -> list[dict]:
    """The committed entries, oldest first; [] when ``directory`` or its manifest does not exist."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint folder")
    manifest = directory / MANIFEST
    try:
        text = manifest.read_text()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest} cannot be read: {error}") from None
    try:
        data = json.loads(text)
        entries = data["checkpoints"]
        valid = data["format"] == FORMAT and data["version"] == VERSION and all(map(_valid_entry, entries))
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise CheckpointError(f"{manifest} is not a fastlm checkpoint manifest (format {FORMAT} version {VERSION})")
    return entries


def _valid_entry(entry: dict) -> bool:
    """Fields of the right types, and a file name that `save` writes (never a path out of the folder)."""
    return (
        isinstance(entry["step"], int)
        and isinstance(entry["bytes"], int)
        and isinstance(entry["sha256"], str)
        and isinstance(entry["config"], dict)
        and isinstance(entry["file"], str)
        and _CHECKPOINT_NAME.fullmatch(entry["file"]) is not None
    )


def _write_manifest(directory: Path, entries: list[dict]) -> None:
    """Replace the manifest atomically: this rename is the moment a save is committed."""
    manifest, temporary = directory / MANIFEST, directory / f"{MANIFEST}.tmp"
    with temporary.open("w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "checkpoints": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, manifest)
    _fsync_directory(directory)


class _HashingWriter:
    """A file for torch.save that counts and hashes the bytes on their way to disk."""

    def __init__(self, file) -> None:
        self.file, self.size, self.sha256 = file, 0, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _write(path: Path, payload: dict) -> tuple[int, str]:
    """torch.save ``payload`` to ``path`` and flush it to disk; returns (bytes, sha256) of what was written."""
    with path.open("wb") as f:
        writer = _HashingWriter(f)
        torch.save(payload, writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.size, writer.sha256.hexdigest()


def _verify(path: Path, size: int, sha256: str) -> None:
    """Read the file back: what is on disk must be what was written."""
    try:
        _check_file(path, size, sha256)
    except CheckpointError as error:
        path.unlink(missing_ok=True)
        raise CheckpointError(f"verifying the new checkpoint failed: {error}") from None


def _check_file(path: Path, size: int, sha256: str) -> None:
    try:
        actual_size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the manifest lists it)") from None
    if actual_size < size:
        raise CheckpointError(f"{path} is truncated: {actual_size} of {size} bytes")
    if actual_size > size:
        raise CheckpointError(f"{path} is corrupt: {actual_size} bytes, {size} expected")
    if _sha256(path) != sha256:
        raise CheckpointError(f"{path} is corrupt: its sha256 differs from the one recorded when it was written")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_unlisted(directory: Path, entries: list[dict]) -> None:
    """Delete the checkpoint files and temporaries of `save` that the manifest does not name; other
    files in the folder are left alone."""
    listed = {e["file"] for e in entries}
    for path in directory.iterdir():
        ours = _CHECKPOINT_NAME.fullmatch(path.name) or _TEMPORARY_NAME.fullmatch(path.name)
        if ours and path.name not in listed:
            path.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (it survives a power loss, not only a killed process)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pause_for_fault_injection() -> None:
    seconds = float(os.environ.get("FASTLM_CHECKPOINT_PAUSE_S", "0"))
    if seconds > 0:
        time.sleep(seconds)


def _shown(config: dict, field: str) -> str:
    return repr(config[field]) if field in config else "(absent)"


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
