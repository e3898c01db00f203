"""`fastlm bench norms` on CPU: the byte model and a real (reduced) run."""

import json

import pytest
import torch

from fastlm.bench.bandwidth import CPU_NOTE
from fastlm.bench.norms import NormsBenchmark, norm_bytes
from fastlm.cli import main


def test_byte_model_by_hand():
    # LayerNorm, 4096 x 16384 bf16: forward reads x and (w, b), writes y and (mean, rstd)
    m, d = 4096, 16384
    assert norm_bytes(m, d, 2, "layer", "fwd") == 2 * m * d * 2 + 2 * d * 2 + 2 * 4 * m
    # backward reads x, dy, w and the stats, writes dx, dw, db
    assert norm_bytes(m, d, 2, "layer", "bwd") == 3 * m * d * 2 + 3 * d * 2 + 2 * 4 * m
    assert norm_bytes(m, d, 4, "rms", "fwd_bwd") == (2 * m * d * 4 + d * 4 + 4 * m) + (
        3 * m * d * 4 + 2 * d * 4 + 4 * m
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_command_runs_on_cpu(tmp_path, capsys):
    assert main(["bench", "norms", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(CPU_NOTE)  # said before the run: what a CPU run does not measure
    assert "norms 1/" in out  # one plain progress line per case when not on a terminal
    report = (tmp_path / "reports" / "norms.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert CPU_NOTE in report and table and not any("CUDA graph" in line for line in table)  # no dash columns
    records = [json.loads(line) for line in (tmp_path / "results" / "norms.jsonl").read_text().splitlines()]
    ok = [r for r in records if r["status"] == "ok"]
    assert {(r["kind"], r["implementation"]) for r in ok} == {
        (k, i) for k in ("layer", "rms") for i in ("eager", "fastlm")
    }
    assert all(r["fwd_bwd_gbps"] > 0 for r in ok)
    assert (tmp_path / "reports" / "norms_fwd_bwd_gbps.png").stat().st_size > 0
    # on a busy CPU a step can time below its own forward: the table's status says why
    for r in ok:
        r.update(fwd_ms=10.0, fwd_p20_ms=9.0, fwd_bwd_ms=15.0, fwd_bwd_p80_ms=16.0)
    ok[0].update(fwd_bwd_ms=5.0, fwd_bwd_p80_ms=6.0)  # p20-p80 ranges apart
    (tmp_path / "results" / "norms.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = NormsBenchmark().render(tmp_path / "results", tmp_path / "reports")
    noted = [line for line in report.splitlines() if "fwd+bwd < fwd" in line]
    assert len(noted) == 1 and "ranges apart: the load changed between the stages, rerun" in noted[0]
    assert f"| {ok[0]['implementation']} |" in noted[0]
