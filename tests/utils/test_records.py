import subprocess

import pytest

from fastlm.utils import records


def _fake_git(status: str):
    def run(argv, **kwargs):
        out = {"rev-parse": "abc1234\n", "status": status}[argv[1]]
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr="")

    return run


@pytest.mark.parametrize(("status", "sha"), [("", "abc1234"), (" M src/fastlm/train/loop.py\n", "abc1234+")])
def test_git_sha_marks_a_tree_that_differs_from_head(status, sha, monkeypatch):
    monkeypatch.delenv("FASTLM_GIT_SHA", raising=False)
    monkeypatch.setattr(subprocess, "run", _fake_git(status))
    assert records._git_sha() == sha


def test_git_sha_given_by_the_environment_wins(monkeypatch):
    monkeypatch.setenv("FASTLM_GIT_SHA", "def5678")
    assert records._git_sha() == "def5678"
