"""`fastlm bench attention` on CPU: the baselines' semantics, sweep shapes, ratios, one real run."""

import pytest
import torch

from fastlm.analysis.attention import attention_forward_flops, scores_bytes
from fastlm.bench import attention, attention_report
from fastlm.cli import main
from fastlm.harness.benchmark import Implementation, Run, measure_or_status
from fastlm.harness.runner import run_benchmark
from fastlm.ops.flash_attention import flash_attention_ref
from fastlm.utils.records import read_records


def test_naive_attention_matches_reference():
    q, k, v = (torch.randn(2, 3, 50, 16, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(attention.naive_attention(q, k, v), flash_attention_ref(q, k, v, causal=True))


def test_flop_count_and_score_bytes():
    # 4 B H N^2 D, halved under the causal mask: the count SDPA and FlashAttention benchmarks use.
    assert attention_forward_flops(2, 16, 4096, 4096, 128, causal=True) == 2 * 2 * 16 * 4096**2 * 128
    assert attention_forward_flops(1, 1, 10, 20, 8, causal=False) == 4 * 10 * 20 * 8
    assert scores_bytes(8, 1, 16384, 16384, 4) == 8 * 2**30


def test_model_sweep_keeps_tokens_per_batch_then_adds_the_short_shapes():
    *shapes, batch_of_short, single = attention.sweep_shapes("model", torch.device("cuda"))
    assert {s.batch * s.seq for s in shapes} == {32768}
    assert {(s.seq, s.head_dim) for s in shapes} == {(n, d) for n in (1024, 4096, 16384) for d in (64, 128)}
    shape = lambda s: (s.batch, s.heads, s.seq, s.head_dim)  # noqa: E731
    assert (shape(batch_of_short), shape(single)) == ((16, 32, 512, 64), (1, 32, 1024, 128))
    with pytest.raises(ValueError, match="unknown sweep"):
        attention.sweep_shapes("bogus", torch.device("cpu"))


def test_model_ratios_divide_tflops_per_shape():
    """Shapes that share N and D (a short single sequence and a batch of them) keep their own ratios."""

    def record(batch, implementation, fwd=None, fwd_bwd=None, status="ok", **graph):
        return {
            "batch": batch,
            "heads": 16,
            "head_dim": 128,
            "seq": 1024,
            "implementation": implementation,
            "status": status,
            "fwd_tflops": fwd,
            "fwd_bwd_tflops": fwd_bwd,
            **graph,
        }

    records = [
        record(32, "fastlm", 400.0, 300.0),
        record(32, "sdpa-flash", 200.0, 250.0),
        record(32, "sdpa-cudnn", status="OOM"),
        record(1, "fastlm", 100.0, 50.0, fwd_bwd_graph_tflops=90.0),
        record(1, "sdpa-flash", 125.0, 100.0, fwd_bwd_graph_tflops=150.0),
    ]
    batched, single = sorted(attention_report.model_ratios(records), key=lambda row: -row["batch"])
    assert batched["fwd_vs_sdpa-flash"] == 2.0 and batched["fwd_bwd_vs_sdpa-flash"] == 1.2
    assert "fwd_vs_sdpa-cudnn" not in batched and "fwd_bwd_graph_vs_sdpa-flash" not in batched
    assert (single["batch"], single["fwd_vs_sdpa-flash"], single["fwd_bwd_vs_sdpa-flash"]) == (1, 0.8, 0.5)
    assert single["fwd_bwd_graph_vs_sdpa-flash"] == 0.6


def test_cpu_model_sweep_runs_and_renders(tmp_path, monkeypatch):
    # One small shape: on CPU the kernels run through the (slow) interpreter.
    tiny = [attention.Shape(2, 2, 64, 32, torch.bfloat16)]
    monkeypatch.setattr(attention, "sweep_shapes", lambda sweep, device: tiny)
    report = run_benchmark(attention.AttentionBenchmark(("model",)), tmp_path, torch.device("cpu"))
    records = read_records(tmp_path / "results" / "attention.jsonl")
    statuses = {r["implementation"]: r["status"] for r in records}
    assert statuses == {"fastlm": "ok", "sdpa-flash": "needs a GPU", "sdpa-cudnn": "needs a GPU"}
    assert all(r["fwd_tflops"] > 0 for r in records if r["status"] == "ok")
    markdown = report.read_text()
    assert "| bfloat16 | 32 | 64 | 2 | fastlm |" in markdown
    # no table of dashes for what a CPU run cannot measure: the SDPA ratios, peak memory
    assert "vs SDPA" not in markdown and "peak MiB" not in markdown
    assert "no fastlm-vs-SDPA ratios" in markdown and attention.CPU_NOTE in markdown
    assert (tmp_path / "reports" / "attention_model_tflops.png").stat().st_size > 0


def test_a_sweep_prints_its_own_tables_not_an_earlier_runs_other_sweep(tmp_path, monkeypatch):
    tiny = [attention.Shape(2, 2, 64, 32, torch.bfloat16)]
    monkeypatch.setattr(attention, "sweep_shapes", lambda sweep, device: tiny)
    run_benchmark(attention.AttentionBenchmark(("model",)), tmp_path, torch.device("cpu"))
    # a later run of another sweep: its report is not followed by the model sweep's table
    text = attention.AttentionBenchmark(("flash",)).render(tmp_path / "results", tmp_path / "reports")
    assert "Model shapes" not in text
    assert "Model shapes" in attention.AttentionBenchmark(("model",)).render(tmp_path / "results", tmp_path)


def test_unknown_sweep_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "attention", "--sweep", "model,bogus"])
    assert exit_info.value.code == 2
    assert "unknown sweep 'bogus'" in capsys.readouterr().err


def test_out_of_memory_is_recorded_not_raised():
    def exhausts_memory(q, k, v):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    impl = Implementation("oom", lambda case: exhausts_memory, "always out of memory")
    case = attention.Case("naive", attention.Shape(1, 0, 16, 8, torch.float32))
    benchmark, run = attention.AttentionBenchmark(("naive",)), Run(torch.device("cpu"), None)
    assert measure_or_status(benchmark, case, impl, run) == {"status": "OOM"}
