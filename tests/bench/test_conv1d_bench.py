"""`fastlm bench conv1d` and `fastlm analyze conv1d` on CPU: byte models by hand, reduced run."""

import json

import pytest
import torch

from fastlm.analysis.conv1d import Conv1dCost
from fastlm.bench.conv1d import conv1d_bytes
from fastlm.cli import main
from fastlm.devices import device_spec


def test_cost_model_by_hand():
    # (1, 8192, 8192), K = 3, fp16: u read + out written + 3 taps and a bias per channel
    n = 8192 * 8192
    cost = Conv1dCost(1, 8192, 8192, 3, 2)
    assert cost.fwd_bytes == 2 * n * 2 + 4 * 8192 * 2
    padded = 8194 * 8192 * 2
    assert cost.padding_pass_bytes == n * 2 + 2 * padded + n * 2 + 4 * 8192 * 2  # about twice the fused
    assert cost.fwd_flops == n * (2 * 3 + 1)
    assert Conv1dCost(1, 1, 1, 4, 2, bias=False, silu=True).flops_per_output == 8 + 4
    assert conv1d_bytes((2, 3, 5), 4, 4, "bwd") == 3 * 30 * 4 + (4 + 1) * 5 * 4 + 4 * 5 * 4
    bound = cost.fwd_bound(device_spec("h100"))
    assert bound.verdict == "memory-bound" and bound.intensity == pytest.approx(cost.fwd_flops / cost.fwd_bytes)
    with pytest.raises(ValueError, match="kernel_size must be positive"):
        Conv1dCost(1, 2, 3, 0)


def test_analyze_command(capsys):
    assert (
        main(
            [
                "analyze",
                "conv1d",
                "--batch",
                "8",
                "--length",
                "4096",
                "--channels",
                "2048",
                "--kernel-size",
                "4",
                "--dtype",
                "bf16",
                "--gpu",
                "h200",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "memory-bound" in out and "padding" in out and "H200" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_command_runs_on_cpu(tmp_path):
    assert main(["bench", "conv1d", "--out", str(tmp_path)]) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "conv1d.jsonl").read_text().splitlines()]
    assert {r["implementation"]: r["status"] for r in records} == {
        "eager": "ok",
        "compile": "needs a GPU",
        "fastlm": "ok",
        "fastlm-cuda": "needs a GPU",
    }
    assert (tmp_path / "reports" / "conv1d_fwd_bwd_gbps.png").stat().st_size > 0
