"""The fused linear + cross-entropy benchmark: its FLOP count, ratios, OOM handling and a real
(reduced) CPU run with records, table and plot."""

import dataclasses

import pytest
import torch

from fastlm.bench import linear_xent
from fastlm.harness.benchmark import Run
from fastlm.utils.records import append_records, read_records

CEILINGS = {"matmul_tflops": 0.5, "copy_gbps": 10.0}  # what `fastlm bench ceilings` records


def measure_all() -> list[dict]:
    """The records of every (case, implementation) on the CPU, against CEILINGS."""
    steps = linear_xent.LinearCrossEntropyBenchmark().measurements(Run(torch.device("cpu"), CEILINGS))
    return [record for step in steps for record in step.records]


def test_matmul_flops_by_hand():
    # N=8192, d=4096, V=128256: logits, grad_hidden and grad_weight, 2 N V d each
    assert linear_xent.matmul_flops(8192, 4096, 128256) == 3 * 2 * 8192 * 128256 * 4096


def test_table_rows_compare_each_case_with_its_eager_row():
    def record(implementation, tokens, ms, peak, status="ok"):
        return {
            "implementation": implementation,
            "tokens": tokens,
            "vocab": 100,
            "status": status,
            "fwd_bwd_ms": ms,
            "fraction_of_matmul": 0.5,
            "peak_excluding_grads_gib": peak,
        }

    rows = linear_xent.table_rows(
        [
            record("eager", 8, 4.0, 2.0),
            record("fastlm", 8, 1.0, 0.25),
            record("eager", 16, 1.0, 1.0, "OOM"),
            record("fastlm", 16, 3.0, 0.5),
        ]
    )
    assert rows[1]["speedup"] == 4.0 and rows[1]["memory_vs_eager"] == 0.125
    assert rows[1]["percent_of_matmul"] == 50.0
    assert "speedup" not in rows[3]  # eager ran out of memory there: no ratio


def test_out_of_memory_is_recorded_and_the_run_goes_on(monkeypatch):
    def out_of_memory(hidden, weight, targets):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    broken = dataclasses.replace(linear_xent.IMPLEMENTATIONS[0], name="broken", make=lambda case: out_of_memory)
    monkeypatch.setattr(linear_xent, "IMPLEMENTATIONS", (broken, linear_xent.IMPLEMENTATIONS[0]))
    records = measure_all()
    assert [(r["implementation"], r["status"]) for r in records] == [("broken", "OOM"), ("eager", "ok")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_cpu_run_writes_records_table_and_plot(tmp_path):
    results, reports = tmp_path / "results", tmp_path / "reports"
    append_records(results / "linear_xent.jsonl", measure_all())
    records = read_records(results / "linear_xent.jsonl")
    assert {r["implementation"]: r["status"] for r in records} == {
        "eager": "ok",
        "compile": "needs a GPU",
        "matmul+fastlm-ce": "ok",
        "fastlm": "ok",
        "liger": "needs a GPU",
        "cce": "needs a GPU",
    }
    fastlm_row = next(r for r in records if r["implementation"] == "fastlm")
    tokens, width, vocab = linear_xent.CPU_CASES[0]
    expected_tflops = 6 * tokens * width * vocab / (fastlm_row["fwd_bwd_ms"] * 1e-3) / 1e12
    assert fastlm_row["tflops"] == pytest.approx(expected_tflops)
    assert fastlm_row["chunk_rows"] == 2**28 // (2 * 100) // 128 * 128  # default bytes of bf16 logits, 128-row tiles
    report = linear_xent.LinearCrossEntropyBenchmark().render(results, reports)
    assert "| 16 | 100 | fastlm |" in report
    assert (reports / "linear_xent_fwd_bwd_ms.png").stat().st_size > 0
    assert not (reports / "linear_xent_peak_memory.png").exists()  # peak memory is measured on CUDA only
