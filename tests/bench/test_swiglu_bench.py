"""`fastlm bench swiglu` on CPU: the byte model and a real (reduced) run."""

import json

import pytest
import torch

from fastlm.bench.swiglu import swiglu_bytes
from fastlm.cli import main


def test_byte_model_by_hand():
    # 8192 x 14336 bf16: the forward reads gate and up, writes y; the backward reads dy, gate, up
    # and writes dgate, dup
    n = 8192 * 14336
    assert swiglu_bytes(8192, 14336, 2, "fwd") == 3 * n * 2
    assert swiglu_bytes(8192, 14336, 2, "bwd") == 5 * n * 2
    assert swiglu_bytes(3, 5, 4, "fwd_bwd") == 8 * 15 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_command_runs_on_cpu(tmp_path):
    assert main(["bench", "swiglu", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "swiglu.jsonl").read_text().splitlines()]
    assert {r["implementation"]: r["status"] for r in records} == {
        "eager": "ok",
        "compile": "needs a GPU",
        "fastlm": "ok",
        "liger": "needs a GPU",
    }
    assert all(r["op"] == "swiglu" and (r["rows"], r["width"]) == (64, 256) for r in records)
    assert all(r["fwd_bwd_gbps"] > 0 for r in records if r["status"] == "ok")
    assert "| 64x256 | float32 | fastlm |" in (tmp_path / "reports" / "swiglu.md").read_text()
    assert (tmp_path / "reports" / "swiglu_fwd_bwd_gbps.png").stat().st_size > 0
