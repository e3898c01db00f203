"""`fastlm.checkpoint`: what a save commits, what it keeps, and a one-line error for every damaged or
foreign checkpoint."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError, ConfigMismatchError

CONFIG = {"preset": "tiny", "batch": 2, "lr": 0.01, "dims": [64, 128]}


def _state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(5, 3, generator=generator)}, "data": {"position": 17, "files": ["a", "b"]}}


def _files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _committed(directory) -> list[dict]:
    return json.loads((directory / checkpoint.MANIFEST).read_text())["checkpoints"]


def test_round_trip(tmp_path):
    state = _state()
    path = checkpoint.save(tmp_path, 7, CONFIG, state)
    loaded = checkpoint.load(tmp_path, CONFIG)
    assert (loaded.step, loaded.config) == (7, CONFIG)
    torch.testing.assert_close(loaded.state["model"]["w"], state["model"]["w"], rtol=0, atol=0)
    assert loaded.state["data"] == state["data"]
    assert _files(tmp_path) == [checkpoint.MANIFEST, path.name]
    entry = checkpoint.newest(tmp_path)
    assert (entry["step"], entry["file"], entry["bytes"]) == (7, path.name, path.stat().st_size)


def test_keeps_the_newest_and_a_resumed_older_step_drops_the_later_ones(tmp_path):
    for step in range(1, 6):
        checkpoint.save(tmp_path, step, CONFIG, _state(step), keep=3)
    assert [e["step"] for e in _committed(tmp_path)] == [3, 4, 5]
    assert len(_files(tmp_path)) == 4  # the manifest and three checkpoints
    # a run resumed from step 3 saves step 4 again: the checkpoints of its steps 4 and 5 go
    kept = checkpoint.newest(tmp_path)
    checkpoint.save(tmp_path, 4, CONFIG, _state(40), keep=3)
    assert [e["step"] for e in _committed(tmp_path)] == [3, 4]
    assert not (tmp_path / kept["file"]).exists()
    torch.testing.assert_close(checkpoint.load(tmp_path).state["model"]["w"], _state(40)["model"]["w"])


def test_an_older_step_loads_on_request_and_a_damaged_newest_names_the_intact_one(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, CONFIG, _state(step), keep=3)
    assert checkpoint.load(tmp_path, CONFIG, step=2).step == 2
    with pytest.raises(CheckpointError, match=r"holds no checkpoint of step 7 \(it holds steps 1, 2, 3\)$"):
        checkpoint.load(tmp_path, step=7)
    _flip_a_byte(tmp_path)  # step 3
    (tmp_path / _committed(tmp_path)[1]["file"]).unlink()  # step 2: the newest intact one is step 1
    with pytest.raises(
        checkpoint.DamagedCheckpointError, match="is corrupt: .*; the older checkpoint of step 1 is intact$"
    ) as raised:
        checkpoint.load(tmp_path, CONFIG)
    assert raised.value.intact_step == 1
    torch.testing.assert_close(checkpoint.load(tmp_path, step=1).state["model"]["w"], _state(1)["model"]["w"])


def test_an_interrupted_save_is_ignored_and_cleaned_up(tmp_path):
    checkpoint.save(tmp_path, 1, CONFIG, _state(1))
    # what a save killed before its commit leaves: a partial temporary, an uncommitted numbered file
    (tmp_path / "step-00000002.pt.tmp").write_bytes(b"partial")
    (tmp_path / "step-00000002-0123456789ab.pt").write_bytes(b"complete but not committed")
    (tmp_path / "notes.txt").write_text("not ours")
    assert checkpoint.load(tmp_path).step == 1
    checkpoint.save(tmp_path, 2, CONFIG, _state(2))
    committed = _committed(tmp_path)
    assert [e["step"] for e in committed] == [1, 2]
    assert _files(tmp_path) == sorted([checkpoint.MANIFEST, "notes.txt", *(e["file"] for e in committed)])


def test_a_file_that_differs_on_disk_is_never_committed(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, CONFIG, _state(1))
    write = checkpoint._write

    def write_then_damage(path, payload):  # a disk that stores other bytes than it was given
        written = write(path, payload)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
        return written

    monkeypatch.setattr(checkpoint, "_write", write_then_damage)
    with pytest.raises(CheckpointError, match="verifying the new checkpoint failed: .* is corrupt"):
        checkpoint.save(tmp_path, 2, CONFIG, _state(2))
    assert checkpoint.load(tmp_path).step == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_config_differences_and_override(tmp_path):
    checkpoint.save(tmp_path, 1, CONFIG, _state())
    changed = {**CONFIG, "lr": 0.1, "batch": 4, "new": 1}
    assert checkpoint.config_differences(CONFIG, changed) == ["batch", "lr", "new"]
    with pytest.raises(ConfigMismatchError) as raised:
        checkpoint.load(tmp_path, changed, override=["lr"])
    assert raised.value.fields == ["batch", "new"]
    assert "batch 2 -> 4" in str(raised.value) and "new (absent) -> 1" in str(raised.value)
    assert checkpoint.load(tmp_path, changed, override=["lr", "batch", "new"]).config == CONFIG


def test_config_must_be_json_data(tmp_path):
    with pytest.raises(ValueError, match="JSON data"):
        checkpoint.save(tmp_path, 1, {"dims": (64, 128)}, _state())  # a tuple would load as a list


class _RunsCode:
    """Unpickling this calls os.mkdir(path): the code a weights_only=False load would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _rewrite_newest(directory, payload) -> None:
    """Replace the newest checkpoint's file and update its size and checksum in the manifest, so only
    the contents are foreign."""
    manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
    entry = manifest["checkpoints"][-1]
    torch.save(payload, directory / entry["file"])
    data = (directory / entry["file"]).read_bytes()
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _newest_file(directory):
    return directory / checkpoint.newest(directory)["file"]


def _truncate(directory):
    path = _newest_file(directory)
    path.write_bytes(path.read_bytes()[:1000])


def _flip_a_byte(directory):
    path = _newest_file(directory)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)


DAMAGE = {
    "missing folder": (lambda d: d.rename(d.with_name("elsewhere")), "does not exist"),
    "a file, not a folder": (lambda d: (shutil.rmtree(d), d.write_text("x")), "is a file"),
    "no manifest": (lambda d: (d / checkpoint.MANIFEST).unlink(), "holds no checkpoint"),
    "manifest not JSON": (lambda d: (d / checkpoint.MANIFEST).write_text("{"), "not a fastlm checkpoint manifest"),
    "manifest of something else": (
        lambda d: (d / checkpoint.MANIFEST).write_text('{"checkpoints": []}'),
        "not a fastlm checkpoint manifest",
    ),
    "checkpoint file missing": (lambda d: _newest_file(d).unlink(), "is missing"),
    "truncated": (_truncate, r"is truncated: 1000 of \d+ bytes"),
    "one byte flipped": (_flip_a_byte, "is corrupt: its sha256 differs"),
    "another torch file": (lambda d: _rewrite_newest(d, {"weights": torch.ones(2)}), "is not a fastlm checkpoint"),
    "pickled code": (lambda d: _rewrite_newest(d, {"x": _RunsCode(d / "ran")}), "would run code"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_or_foreign_checkpoints_fail_with_one_line(damage, tmp_path):
    directory = tmp_path / "run"
    checkpoint.save(directory, 1, CONFIG, _state())
    damage_fn, message = DAMAGE[damage]
    damage_fn(directory)
    with pytest.raises(CheckpointError, match=message) as raised:
        checkpoint.load(directory, CONFIG)
    assert len(str(raised.value).splitlines()) == 1
    assert str(directory) in str(raised.value)
    assert not (directory / "ran").exists()
