"""`fastlm bench softmax` on CPU: the byte model and a real (reduced) run."""

import json

import pytest
import torch

from fastlm.bench.softmax import softmax_bytes
from fastlm.cli import main


def test_byte_model_by_hand():
    # (2, 16, 4096, 4096) bf16: the forward reads x and the (2, 1, 1, 4096) mask, writes y
    n = 2 * 16 * 4096 * 4096
    assert softmax_bytes((2, 16, 4096, 4096), 2, "fwd") == 2 * n * 2 + 2 * 4096 * 2
    assert softmax_bytes((2, 16, 4096, 4096), 2, "bwd") == 3 * n * 2  # y, dy read; dx written
    assert softmax_bytes((1, 1, 2, 3), 4, "fwd_bwd") == (2 * 6 * 4 + 3 * 4) + 3 * 6 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_command_runs_on_cpu(tmp_path):
    assert main(["bench", "softmax", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "softmax.jsonl").read_text().splitlines()]
    assert {r["implementation"]: r["status"] for r in records} == {
        "eager": "ok",
        "compile": "needs a GPU",
        "fastlm": "ok",
    }
    assert all(r["fwd_bwd_gbps"] > 0 for r in records if r["status"] == "ok")
    assert "Masked softmax" in (tmp_path / "reports" / "softmax.md").read_text()
    assert (tmp_path / "reports" / "softmax_fwd_bwd_gbps.png").stat().st_size > 0
