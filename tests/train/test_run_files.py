"""Nothing of a run is lost: a run never replaces another run's files without --overwrite, which
keeps the old run aside until the new one has a checkpoint; a resumed log is one run's story; a
damaged newest checkpoint names the intact older one, which --resume STEP continues; damaged token
data and unusable --out folders are one-line errors before any work."""

import json
import shutil

import numpy as np
import pytest

from fastlm import checkpoint
from fastlm.data.manifest import MANIFEST, sample_sha256
from fastlm.data.tokens import TokenData
from fastlm.train import loop
from fastlm.train.checkpoint import checkpoint_dir, load_for_resume
from fastlm.train.config import IMPLIED_BY_OLDER_RUNS
from fastlm.train.log import read_log, set_aside_runs
from fastlm.utils.errors import UserError

SMALL = ["--preset", "tiny", "--context", "16", "--micro-batch", "2", "--log-every", "1", "--eval-sequences", "4"]


def _main(corpus_data, out, *argv) -> int:
    return loop.main(["--data", str(corpus_data), *SMALL, "--out", str(out), *argv])


def _snapshot(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("log.jsonl", "run.json", "loss.png")}


def _error(capsys) -> str:
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1, error
    return error


def test_a_second_run_never_replaces_the_first_without_overwrite(corpus_data, tmp_path, capsys):
    # no checkpoints: the log, run record and plot are all there is of the first run
    assert _main(corpus_data, tmp_path, "--steps", "2", "--checkpoint-every", "0") == 0
    first = _snapshot(tmp_path)
    assert _main(corpus_data, tmp_path, "--steps", "3", "--checkpoint-every", "0") == 2
    assert "holds another run's log.jsonl, run.json, loss.png: pass --overwrite" in _error(capsys)
    assert _snapshot(tmp_path) == first
    assert _main(corpus_data, tmp_path, "--steps", "3", "--checkpoint-every", "0", "--overwrite") == 0
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [0, 1, 2, 3]
    assert not list(tmp_path.glob("previous-*"))  # the new run ended: the old one is gone


class _Stopped(Exception):
    pass


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(corpus_data, tmp_path, capsys, monkeypatch):
    assert _main(corpus_data, tmp_path, "--steps", "4", "--checkpoint-every", "2") == 0
    old = {**_snapshot(tmp_path), "manifest": (tmp_path / "checkpoints" / checkpoint.MANIFEST).read_bytes()}

    def stop(*args, **kwargs):  # the process dies before the new run's first checkpoint
        raise _Stopped

    monkeypatch.setattr(loop, "save_checkpoint", stop)
    with pytest.raises(_Stopped):
        _main(corpus_data, tmp_path, "--steps", "4", "--checkpoint-every", "2", "--lr", "1e-2", "--overwrite")
    monkeypatch.undo()
    (aside,) = tmp_path.glob("previous-*")
    assert {**_snapshot(aside), "manifest": (aside / "checkpoints" / checkpoint.MANIFEST).read_bytes()} == old
    # the stopped run left no checkpoint to continue; the old run is named, never mixed with it
    assert _main(corpus_data, tmp_path, "--steps", "6", "--resume", "--override", "steps") == 2
    assert f"holds no checkpoint to continue (the run --overwrite replaced is in {aside}" in _error(capsys)
    for path in aside.iterdir():  # as the message says: its files moved back, it continues
        (tmp_path / path.name).unlink(missing_ok=True)
        path.rename(tmp_path / path.name)
    assert (
        _main(corpus_data, tmp_path, "--steps", "6", "--checkpoint-every", "2", "--resume", "--override", "steps") == 0
    )
    old_log = [json.loads(line) for line in old["log.jsonl"].decode().splitlines()]
    log = read_log(tmp_path / "log.jsonl")
    assert [r["step"] for r in log] == list(range(7)) and log[:5] == old_log


def test_resume_refuses_a_log_of_another_run(corpus_data, tmp_path, capsys):
    assert _main(corpus_data, tmp_path / "a", "--steps", "2") == 0
    assert _main(corpus_data, tmp_path / "b", "--steps", "1", "--checkpoint-every", "0") == 0
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    log = (tmp_path / "b" / "log.jsonl").read_bytes()
    assert _main(corpus_data, tmp_path / "b", "--steps", "3", "--resume", "--override", "steps") == 2
    assert "log.jsonl belong to another run than the checkpoints in" in _error(capsys)
    assert (tmp_path / "b" / "log.jsonl").read_bytes() == log


def test_a_damaged_newest_checkpoint_names_the_intact_one_and_resume_takes_it(corpus_data, tmp_path, capsys):
    argv = ["--steps", "3", "--checkpoint-every", "1", "--keep-checkpoints", "2"]
    assert _main(corpus_data, tmp_path / "straight", *argv) == 0
    out = tmp_path / "damaged"
    shutil.copytree(tmp_path / "straight", out)
    newest = out / "checkpoints" / checkpoint.newest(out / "checkpoints")["file"]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 1
    newest.write_bytes(data)
    assert _main(corpus_data, out, *argv, "--resume") == 1
    error = _error(capsys)
    assert f"{newest} is corrupt" in error
    assert error.rstrip().endswith("the older checkpoint of step 2 is intact; pass --resume 2 to continue from it")
    assert _main(corpus_data, out, *argv, "--resume", "9") == 2  # a step not kept: a mistake in the arguments
    assert (
        ": --resume 9: " in (error := _error(capsys)) and "holds no checkpoint of step 9 (it keeps steps 2, 3;" in error
    )
    assert _main(corpus_data, out, *argv, "--resume", "2") == 0
    untimed = [{k: r[k] for k in ("step", "loss", "eval_loss") if k in r} for r in read_log(out / "log.jsonl")]
    straight = [
        {k: r[k] for k in ("step", "loss", "eval_loss") if k in r}
        for r in read_log(tmp_path / "straight" / "log.jsonl")
    ]
    assert untimed == straight  # steps 0-2 kept, step 3 trained again on the same tokens


def _corrupt_in_place(data_dir, resample: bool) -> None:
    """Every tenth token id of the first shard set to 65535, its size unchanged; ``resample``
    records the new sample hash, as if the damage lay outside the sampled blocks."""
    manifest = json.loads((data_dir / MANIFEST).read_text())
    shard = data_dir / manifest["shards"][0]["file"]
    tokens = np.fromfile(shard, dtype=manifest["dtype"])
    tokens[::10] = 65535
    tokens.tofile(shard)
    if resample:
        manifest["shards"][0]["sample_sha256"] = sample_sha256(shard)
        (data_dir / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("resample", [False, True], ids=["found on open", "found in a batch"])
def test_damaged_token_data_is_a_one_line_error(corpus_data, tmp_path, capsys, resample):
    data = tmp_path / "data"
    shutil.copytree(corpus_data, data)
    _corrupt_in_place(data, resample)
    assert loop.main(["--data", str(data), *SMALL, "--out", str(tmp_path / "run"), "--steps", "40"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    if resample:
        assert "the data holds token id 65535, outside its vocabulary of 257 ids" in error
    else:
        assert "changed after it was prepared (a sampled block differs from the manifest's)" in error


@pytest.mark.parametrize("out", ["{file}/sub", "{file}", "/proc/fastlm-run"])
def test_an_unusable_out_is_one_line_before_any_work(corpus_data, tmp_path, capsys, out):
    (tmp_path / "file").write_text("x")
    out = out.format(file=tmp_path / "file")
    assert _main(corpus_data, out, "--steps", "1") == 2
    assert _error(capsys).startswith(f"python -m fastlm.train: error: --out {out} ")


def test_torchrun_without_parallel_and_out_in_the_data_folder_are_refused(corpus_data, tmp_path, capsys, monkeypatch):
    """Processes that torchrun started with --parallel none would each train the whole run into
    the same --out; an --out that is the data folder would mix the run's files with the data's."""
    assert _main(corpus_data, corpus_data, "--steps", "1") == 2
    assert _error(capsys).startswith("python -m fastlm.train: error: --out must be a folder of its own, not the --data")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _main(corpus_data, tmp_path, "--steps", "1") == 2
    assert "torchrun started 2 processes but --parallel is none: pass --parallel ddp" in _error(capsys)
    assert not any(tmp_path.iterdir())


def test_ctrl_c_says_how_to_go_on(corpus_data, tmp_path, capsys, monkeypatch):
    """Ctrl-C ends the run with status 130 and one line instead of a traceback: --resume where a
    checkpoint exists; where none does yet, --overwrite, or under --overwrite where the run it
    replaces waits. A resumed run says where it resumed from, and a --warmup as long as the run
    says that the learning rate never reaches --lr."""
    save = loop.save_checkpoint

    def interrupt_after_the_first_checkpoint(config, *args):
        if checkpoint.newest(checkpoint_dir(config)):
            raise KeyboardInterrupt
        save(config, *args)

    monkeypatch.setattr(loop, "save_checkpoint", interrupt_after_the_first_checkpoint)
    assert _main(corpus_data, tmp_path, "--steps", "6", "--checkpoint-every", "2") == 130
    assert capsys.readouterr().err.strip() == (
        "python -m fastlm.train: interrupted; --resume (without --overwrite) continues from the checkpoint of step 2"
    )
    monkeypatch.setattr(loop, "save_checkpoint", save)
    assert _main(corpus_data, tmp_path, "--steps", "6", "--checkpoint-every", "2", "--resume") == 0
    assert "resumed from the checkpoint of step 2 in" in capsys.readouterr().out

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", interrupt)  # stops each run below before its first step
    assert _main(corpus_data, tmp_path, "--steps", "3", "--overwrite") == 130
    (aside,) = set_aside_runs(tmp_path)
    assert capsys.readouterr().err.strip() == (
        f"python -m fastlm.train: interrupted before its first checkpoint; the run it replaces is in {aside} (move "
        "its files back to keep it): the same command starts again, and deletes it once it saves a checkpoint"
    )
    fresh = tmp_path / "fresh"
    assert _main(corpus_data, fresh, "--steps", "3", "--warmup", "5") == 130
    captured = capsys.readouterr()
    assert "--warmup 5 >= --steps 3: the learning rate never reaches --lr" in captured.out
    assert captured.err.strip() == (
        "python -m fastlm.train: interrupted before its first checkpoint (--checkpoint-every 1000): --overwrite "
        "starts it again"
    )
    assert _main(corpus_data, tmp_path / "none", "--steps", "3", "--checkpoint-every", "0") == 130
    assert "with --checkpoint-every 0 it saved no checkpoint: --overwrite starts it again" in capsys.readouterr().err


def test_a_checkpoint_of_an_older_version_resumes_with_what_it_did(corpus_data, tmp_path):
    """Checkpoints written before --documents, --window, --global-every and --reduce-dtype existed
    record none of them: they compare as the behaviour they had (attention across documents), so
    --no-documents resumes them and the new default says what would change."""

    def config_of(*argv):
        return loop.parse_args(["--data", str(corpus_data), *SMALL, "--out", str(tmp_path), *argv]).resolved(gpu=False)

    config = config_of("--steps", "3", "--resume", "--no-documents")
    data = TokenData(config.data)
    record = config.run_record(1, data.sha256, data.tokenizer, data.vocab_size)
    older = {field: value for field, value in record.items() if field not in IMPLIED_BY_OLDER_RUNS}
    checkpoint.save(checkpoint_dir(config), 2, older, {"model": {}})
    assert load_for_resume(config, record).step == 2
    config = config_of("--steps", "3", "--resume")
    changed = r"\(documents False -> True\); documents \(--documents\) cannot change when resuming"
    with pytest.raises(UserError, match=changed):
        load_for_resume(config, config.run_record(1, data.sha256, data.tokenizer, data.vocab_size))


@pytest.mark.parametrize(
    "norm,shown",
    [
        (0.9402, "grad norm 0.940"),
        (0.0, "grad norm 0.000"),
        (3.2e-7, "grad norm 3.20e-07"),
        (float("nan"), "grad norm nan"),
    ],
)
def test_log_line_shows_a_vanishing_gradient_norm(norm, shown):
    from fastlm.train.log import format_record

    assert format_record({"step": 2, "grad_norm": norm}, 10) == f"step 2/10 | {shown}"
