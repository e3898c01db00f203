"""`fastlm bench allreduce` on CPU (gloo): the bandwidth formulas and a small real run."""

import json

import pytest

from fastlm.bench.distributed.allreduce import GLOO_NOTE, bus_bandwidth, render
from fastlm.cli import main


def test_bus_bandwidth_is_the_ring_traffic_per_link():
    assert bus_bandwidth(10.0, 2) == 10.0  # 2 ranks: every byte crosses the one link once each way
    assert bus_bandwidth(10.0, 4) == pytest.approx(15.0)  # 2 (n-1) / n = 1.5
    assert bus_bandwidth(8.0, 8) == pytest.approx(14.0)


def test_command_measures_every_size_and_process_count(tmp_path, capfd):
    assert (
        main(
            [
                "bench",
                "allreduce",
                "--backend",
                "gloo",
                "--procs",
                "2,3",
                "--sizes-mb",
                "0.01,0.1",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = (tmp_path / "results" / "allreduce.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["world"], r["size_mb"]) for r in records] == [(2, 0.01), (2, 0.1), (3, 0.01), (3, 0.1)]
    for r in records:
        assert r["median_ms"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["size_mb"] * 1e6 / (r["median_ms"] / 1e3) / 1e9, rel=1e-3)
    assert (tmp_path / "reports" / "allreduce_busbw_gloo.png").stat().st_size > 0
    report = (tmp_path / "reports" / "allreduce.md").read_text()
    assert "## gloo" in report and GLOO_NOTE in report
    out = capfd.readouterr().out  # the note first, then a line per process count and, from rank 0, per size
    assert out.startswith(GLOO_NOTE)
    assert "all-reduce, 3 processes (gloo): 2 sizes" in out and "all-reduce, 3 processes, 0.1 MB: " in out


def test_nccl_without_gpus_is_a_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["bench", "allreduce", "--backend", "nccl", "--procs", "2"]) == 2
    assert "--backend nccl needs one GPU per process" in capsys.readouterr().err


def test_report_shows_the_latest_run_of_each_backend(tmp_path):
    def row(run_id, backend, median_ms):
        return {
            "run_id": run_id,
            "backend": backend,
            "gpu": "cpu" if backend == "gloo" else "GPU",
            "torch": "2",
            "git_sha": run_id,
            "date": "d",
            "iters": 5,
            "world": 2,
            "size_mb": 1.0,
            "median_ms": median_ms,
            "algbw_gbps": 1.0,
            "busbw_gbps": 1.0,
        }

    results = tmp_path / "results"
    results.mkdir()
    records = [row("old-nccl", "nccl", 11.0), row("gloo-run", "gloo", 22.0), row("new-nccl", "nccl", 33.0)]
    (results / "allreduce.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = render(results, tmp_path / "reports")
    assert report.index("## nccl") < report.index("## gloo")
    assert "git new-nccl" in report and "git gloo-run" in report and "git old-nccl" not in report
    assert "| 33 |" in report and "| 22 |" in report and "| 11 |" not in report
    for backend in ("nccl", "gloo"):
        assert (tmp_path / "reports" / f"allreduce_busbw_{backend}.png").stat().st_size > 0
