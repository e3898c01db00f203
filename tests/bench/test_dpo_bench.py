"""The DPO benchmark: every implementation computes the same loss and gradients, its FLOP count and
ratios, and a real (reduced) CPU run with records, table and plot."""

import pytest
import torch

from fastlm.bench import dpo
from fastlm.harness.benchmark import Run
from fastlm.utils.records import append_records, read_records

CEILINGS = {"matmul_tflops": 0.5, "copy_gbps": 10.0}  # what `fastlm bench ceilings` records


def test_the_cpu_implementations_compute_the_same_loss_and_gradients():
    """fastlm's fused path against the eager one (logits + log_softmax + gather) on the benchmark's
    inputs in fp32, prompt positions left out."""
    length, pairs, width, vocab = dpo.CPU_CASES[0]
    hidden = torch.randn(2 * pairs, length, width, requires_grad=True)
    weight = (torch.randn(vocab, width) * 3 / width**0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (2 * pairs, length))
    targets[:, : length // dpo.PROMPT_FRACTION] = dpo.IGNORE
    results = []
    for make in (dpo._eager, dpo._fastlm):
        loss = make(None)(hidden, weight, targets)
        results.append([loss, *torch.autograd.grad(loss, (hidden, weight))])
    for ours, eager in zip(*results, strict=True):
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-6)


def test_matmul_flops_by_hand():
    # 4 pairs of 1024 tokens: 8192 rows of the LM head, d=4096, V=128256; logits, grad_hidden, grad_weight
    case = dpo.Case(1024, 4, 4096, 128256)
    assert dpo.matmul_flops(case.tokens, case.width, case.vocab) == 3 * 2 * 8192 * 128256 * 4096


def test_table_rows_compare_each_case_with_its_eager_row():
    def record(implementation, pairs, ms, peak, status="ok"):
        return {
            "implementation": implementation,
            "length": 8,
            "pairs": pairs,
            "status": status,
            "fwd_bwd_ms": ms,
            "peak_excluding_grads_gib": peak,
        }

    rows = dpo.table_rows(
        [
            record("eager", 2, 4.0, 2.0),
            record("fastlm", 2, 1.0, 0.25),
            record("eager", 4, 1.0, 1.0, "OOM"),
            record("fastlm", 4, 3.0, 0.5),
        ]
    )
    assert rows[1]["speedup"] == 4.0 and rows[1]["memory_vs_eager"] == 0.125
    assert "speedup" not in rows[3]  # eager ran out of memory there: no ratio


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_cpu_run_writes_records_table_and_plot(tmp_path):
    results, reports = tmp_path / "results", tmp_path / "reports"
    steps = dpo.DPOBenchmark().measurements(Run(torch.device("cpu"), CEILINGS))
    append_records(results / "dpo.jsonl", [record for step in steps for record in step.records])
    records = read_records(results / "dpo.jsonl")
    assert {r["implementation"]: r["status"] for r in records} == {
        "eager": "ok",
        "compile": "needs a GPU",
        "fastlm": "ok",
        "liger": "needs a GPU",
    }
    fastlm_row = next(r for r in records if r["implementation"] == "fastlm")
    length, pairs, width, vocab = dpo.CPU_CASES[0]
    assert fastlm_row["tokens"] == 2 * pairs * length
    expected_tflops = 6 * 2 * pairs * length * width * vocab / (fastlm_row["fwd_bwd_ms"] * 1e-3) / 1e12
    assert fastlm_row["tflops"] == pytest.approx(expected_tflops)
    report = dpo.DPOBenchmark().render(results, reports)
    assert f"| {length} | {pairs} | fastlm |" in report
    assert (reports / "dpo_fwd_bwd_ms.png").stat().st_size > 0
    assert not (reports / "dpo_peak_memory.png").exists()  # peak memory is measured on CUDA only
