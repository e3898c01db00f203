"""The benchmark harness and the CLI on CPU: records, summaries, tables, plots, errors."""

import json
import math

import pytest
import torch

from fastlm.bench import xent
from fastlm.bench.bandwidth import measure_stages, render_bandwidth
from fastlm.cli import main
from fastlm.harness.benchmark import Benchmark, Implementation, Run, measure_or_status
from fastlm.harness.timing import measure, measure_after_setup, measure_graph_replay
from fastlm.utils.records import append_records, latest_run, latest_runs_by, read_records
from fastlm.utils.tables import markdown_table, present_columns, si, si_seconds


def test_measure_returns_ordered_quantiles():
    timing = measure(lambda: torch.randn(64, 64) @ torch.randn(64, 64), torch.device("cpu"), rep_ms=20)
    assert 0 < timing.p20_ms <= timing.median_ms <= timing.p80_ms


def test_cpu_timing_resolves_a_call_shorter_than_the_clocks_tick():
    from fastlm.harness.timing import _measure_cpu

    now = [0.0]  # virtual seconds: each call takes 1 ms, the clock ticks every 8 ms

    def call():
        now[0] += 1e-3

    timing = _measure_cpu(call, 400.0, (), clock=lambda: 8e-3 * math.floor(now[0] / 8e-3))
    assert timing.median_ms == pytest.approx(1.0, rel=0.3)  # one call per sample: 0 ms most of the time


def test_measure_after_setup_excludes_setup():
    import time

    timing = measure_after_setup(lambda: time.sleep(0.01), lambda _: None, torch.device("cpu"), reps=5)
    assert timing.median_ms < 5  # the 10 ms setup is not counted


def test_measure_after_setup_on_a_cpu_stops_at_its_time_budget():
    """Slow CPU reps stop once 5 of them took REP_MS, not after all 40."""
    import time

    from fastlm.harness.timing import REP_MS

    calls = []
    measure_after_setup(lambda: None, lambda _: (calls.append(1), time.sleep(REP_MS / 4e3)), torch.device("cpu"))
    assert len(calls) == 3 + 5  # warm-up, then the 5 reps that fill the budget


def test_graph_replay_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        measure_graph_replay(lambda: None, torch.device("cpu"))


def _layer_norm_stages(device, copy_gbps=1000.0):
    x = torch.randn(512, 1024, device=device, requires_grad=True)
    w = torch.randn(1024, device=device, requires_grad=True)
    stage_bytes = {"fwd": 1, "bwd": 1, "fwd_bwd": 10**6}

    def fn(x, w):
        return torch.nn.functional.layer_norm(x, (1024,), w)

    return measure_stages(fn, (x, w), torch.randn_like(x), stage_bytes, copy_gbps, device), (x, w)


def test_stages_on_cpu_have_no_graph_replay():
    record, _ = _layer_norm_stages(torch.device("cpu"))
    assert record["status"] == "ok" and record["fwd_bwd_ms"] > 0
    assert not any("graph" in key for key in record)


@pytest.mark.gpu
def test_gpu_graph_replay_times_the_captured_backward():
    record, leaves = _layer_norm_stages(torch.device("cuda"))
    assert "fwd_graph_status" not in record and "fwd_bwd_graph_status" not in record
    assert 0 < record["fwd_graph_ms"] < record["fwd_bwd_graph_ms"]
    gbps = 10**6 / (record["fwd_bwd_graph_ms"] * 1e-3) / 1e9
    assert record["fwd_bwd_graph_fraction_of_copy"] == pytest.approx(gbps / 1000.0)
    assert record["fwd_graph_fraction_of_copy"] == pytest.approx(1 / (record["fwd_graph_ms"] * 1e-3) / 1e9 / 1000.0)
    assert all(t.grad is None for t in leaves)  # no gradient left pointing into the graph's pool


def test_bandwidth_report_shows_the_graph_replay_column_and_ticks(tmp_path):
    common = {
        "gpu": "GPU",
        "torch": "2",
        "triton": "3",
        "git_sha": "abc",
        "date": "today",
        "copy_gbps_measured": 3000.0,
    }
    records = [
        {
            **common,
            "case": "a",
            "implementation": "fastlm",
            "status": "ok",
            "fwd_ms": 0.1,
            "fwd_bwd_ms": 0.5,
            "fwd_gbps": 2000.0,
            "fwd_fraction_of_copy": 0.66,
            "fwd_bwd_gbps": 600.0,
            "fwd_bwd_fraction_of_copy": 0.2,
            "fwd_graph_ms": 0.05,
            "fwd_graph_gbps": 2700.0,
            "fwd_graph_fraction_of_copy": 0.9,
            "fwd_bwd_graph_ms": 0.14,
            "fwd_bwd_graph_gbps": 2400.0,
            "fwd_bwd_graph_fraction_of_copy": 0.8,
        },
        {
            **common,
            "case": "a",
            "implementation": "liger",
            "status": "ok",
            "fwd_ms": 0.1,
            "fwd_bwd_ms": 0.5,
            "fwd_gbps": 2000.0,
            "fwd_fraction_of_copy": 0.66,
            "fwd_bwd_gbps": 600.0,
            "fwd_bwd_fraction_of_copy": 0.2,
            "fwd_graph_status": "error: capture failed",
            "fwd_bwd_graph_status": "error: capture failed",
        },
    ]
    text = render_bandwidth(records, [("case", "case")], lambda r: r["case"], tmp_path / "plot.png", "t")
    row = next(line for line in text.splitlines() if line.startswith("| a | fastlm"))
    assert row.split(" | ")[-4] == "90"  # fwd % of copy, CUDA graph
    assert row.split(" | ")[-2] == "80"  # fwd+bwd % of copy, CUDA graph
    assert "ok; fwd CUDA graph error: capture failed; fwd+bwd CUDA graph error: capture failed" in text
    assert (tmp_path / "plot.png").stat().st_size > 0


class _Toy(Benchmark):
    """Two cases x three implementations: one that runs, one that needs a GPU, one that is missing."""

    name = "toy"
    title = "Toy benchmark"
    progress_name = "toy"

    def cases(self, device):
        return [1, 2]

    def implementations(self, case):
        return (
            Implementation("square", lambda case: lambda: case * case),
            Implementation("gpu", lambda case: lambda: 0, needs_gpu=True),
            Implementation("missing", lambda case: "missing: toy-kernels is not installed"),
        )

    def describe(self, case, implementation, run):
        return {"op": "toy", "case": case, "implementation": implementation.name}

    def label(self, case, implementation):
        return f"{case} {implementation.name}"

    def measure(self, case, fn, run):
        return {"status": "ok", "value": fn()}

    def render(self, results_dir, reports_dir):
        return markdown_table(read_records(results_dir / self.results_file), [("case", "case"), ("status", "status")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU-only implementation runs on a GPU")
def test_runner_appends_records_writes_the_report_and_prints_a_line_per_step(tmp_path, capsys):
    from fastlm.harness.runner import run_benchmark

    report = run_benchmark(_Toy(), tmp_path, torch.device("cpu"))
    statuses = {"square": "ok", "gpu": "needs a GPU", "missing": "missing: toy-kernels is not installed"}
    steps = [(case, name) for case in (1, 2) for name in statuses]
    records = read_records(tmp_path / "results" / "toy.jsonl")
    assert [(r["case"], r["implementation"], r["status"]) for r in records] == [(c, n, statuses[n]) for c, n in steps]
    assert records[3]["value"] == 4 and all(r["gpu"] == "cpu" and "run_id" in r for r in records)
    assert report == tmp_path / "reports" / "toy.md"
    assert report.read_text().startswith("# Toy benchmark\n\n| case | status |")
    # piped output: a line at once, then one plain line per step, no bar
    lines = [f"toy {i}/6: {c} {n}" for i, (c, n) in enumerate(steps, 1)]
    assert capsys.readouterr().out.splitlines() == ["toy: 6 measurements", *lines]
    assert all(json.loads(line)["complete"] for line in (tmp_path / "results" / "toy.jsonl").read_text().splitlines())


class _Interrupted(_Toy):
    """Ctrl-C during the second case."""

    def measure(self, case, fn, run):
        if case == 2:
            raise KeyboardInterrupt
        return super().measure(case, fn, run)


def test_an_interrupted_run_stays_partial_and_never_replaces_a_complete_one(tmp_path, monkeypatch, capsys):
    from fastlm.harness.runner import run_benchmark
    from fastlm.utils import records

    cpu = torch.device("cpu")
    environment = records.environment()
    monkeypatch.setattr(records, "environment", lambda: {**environment, "run_id": "complete-run"})
    run_benchmark(_Toy(), tmp_path, cpu)
    monkeypatch.setattr(records, "environment", lambda: {**environment, "run_id": "interrupted-run"})
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(_Interrupted(), tmp_path, cpu)
    path = tmp_path / "results" / "toy.jsonl"
    written = [json.loads(line) for line in path.read_text().splitlines()]
    # the interrupted run's records of case 1 are kept, marked partial
    assert [(r["run_id"], r["complete"]) for r in written[6:]] == [("interrupted-run", False)] * 3
    assert {r["run_id"] for r in latest_run(read_records(path))} == {"complete-run"}
    assert _Toy().latest_records(tmp_path / "results") == read_records(path)
    assert "kept as partial" in capsys.readouterr().out.splitlines()[-1]


class _Measuring(_Toy):
    measures_ceilings = True


def test_an_interrupted_runs_ceilings_never_become_the_latest(tmp_path, monkeypatch):
    """Ceilings measured by a run are partial until it ends, as its records: the roofline and the
    ratios of later reports keep the complete run's."""
    from fastlm.harness import ceilings
    from fastlm.harness.runner import run_benchmark

    rates = iter([1.0, 9.0])
    monkeypatch.setattr(
        ceilings, "measure_ceilings", lambda device: {"gpu": "cpu", "run_id": "r", "copy_gbps": next(rates)}
    )
    cpu = torch.device("cpu")
    run_benchmark(_Measuring(), tmp_path, cpu)

    class Interrupted(_Measuring, _Interrupted):
        pass

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(Interrupted(), tmp_path, cpu)
    written = [json.loads(line) for line in (tmp_path / "results" / "ceilings.jsonl").read_text().splitlines()]
    assert [(r["copy_gbps"], r["complete"]) for r in written] == [(1.0, True), (9.0, False)]
    assert ceilings.latest_ceilings(tmp_path / "results", "cpu")["copy_gbps"] == 1.0


def test_the_roofline_skips_a_partial_run(tmp_path):
    from fastlm.bench.roofline import kernel_points

    complete = {"run_id": "a", "gpu": "cpu", "implementation": "fastlm", "status": "ok", "batch": 4, "vocab": 64}
    append_records(tmp_path / "xent.jsonl", [{**complete, "fwd_ms": 1.0}])
    # a later run interrupted after its first record: its point would replace the complete run's
    append_records(tmp_path / "xent.jsonl", [{**complete, "run_id": "b", "fwd_ms": 9.0, "complete": False}])
    [point] = kernel_points(tmp_path, "cpu")
    assert point.seconds == 1e-3


def test_report_counts_one_k_of_n_across_its_sections_and_says_no_gpu_once(tmp_path, monkeypatch, capsys):
    from fastlm.cli import report

    class Noted(_Toy):
        cpu_note = "No GPU: the toy's own note"

    class Other(Noted):
        name, title, progress_name = "other", "Other benchmark", "other"

    monkeypatch.setattr(report, "report_sections", lambda on_gpu: ((Noted(), "Toy", False), (Other(), "Other", False)))
    assert main(["report", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("No GPU") == 0 and out.count("no GPU") == 1  # the report's paragraph only
    counted = [line for line in out.splitlines() if line.startswith("report ")]
    assert counted == [
        f"report {i}/12: {name} {case} {impl}"
        for i, (name, case, impl) in enumerate(
            [(b, c, n) for b in ("toy", "other") for c in (1, 2) for n in ("square", "gpu", "missing")], 1
        )
    ]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "OOM"),
        (RuntimeError("cuDNN rejects this shape\nmore detail"), "error: cuDNN rejects this shape"),
    ],
)
def test_a_failed_measurement_becomes_the_status(error, status):
    class Failing(_Toy):
        def measure(self, case, fn, run):
            raise error

    impl = Implementation("square", lambda case: lambda: case)
    assert measure_or_status(Failing(), 1, impl, Run(torch.device("cpu"), None)) == {"status": status}


def test_records_round_trip_and_latest_run(tmp_path):
    path = tmp_path / "r.jsonl"
    append_records(path, [{"run_id": "a", "x": 1}, {"run_id": "a", "x": 2}])
    append_records(path, [{"run_id": "b", "x": 3}])
    assert [r["x"] for r in read_records(path)] == [1, 2, 3]
    assert [r["x"] for r in latest_run(read_records(path))] == [3]


def test_latest_runs_by_keeps_each_keys_latest_run_whole():
    records = [
        {"run_id": "a", "world": 2, "x": 1},
        {"run_id": "a", "world": 4, "x": 2},
        {"run_id": "b", "world": 8, "x": 3},
        {"run_id": "c", "world": 4, "x": 4},
    ]
    runs = latest_runs_by(records, "world")
    assert [[r["x"] for r in run] for run in runs] == [[1], [3], [4]]


def test_speedups_are_geometric_means():
    records = [
        {"vocab": 1, "implementation": "eager", "status": "ok", "fwd_bwd_ms": 4.0},
        {"vocab": 2, "implementation": "eager", "status": "ok", "fwd_bwd_ms": 9.0},
        {"vocab": 1, "implementation": "fast", "status": "ok", "fwd_bwd_ms": 1.0},
        {"vocab": 2, "implementation": "fast", "status": "ok", "fwd_bwd_ms": 1.0},
        {"vocab": 2, "implementation": "gone", "status": "missing: not installed"},
    ]
    result = xent.speedups(records)
    assert result["fast"] == pytest.approx(math.sqrt(4 * 9))
    assert result["eager"] == pytest.approx(1.0)
    assert "gone" not in result


def test_xent_table_explains_fwd_bwd_below_fwd():
    common = {"vocab": 8, "status": "ok", "fwd_fraction_of_copy": 0.1, "fwd_ms": 10.0, "fwd_p20_ms": 9.0}
    noisy = {**common, "implementation": "fastlm-fused", "fwd_bwd_ms": 9.5, "fwd_bwd_p80_ms": 11.0}
    apart = {**common, "implementation": "fastlm", "fwd_bwd_ms": 5.0, "fwd_bwd_p80_ms": 6.0}
    plain = {**common, "implementation": "eager", "fwd_bwd_ms": 15.0, "fwd_bwd_p80_ms": 16.0}
    status = {row["implementation"]: row["status"] for row in xent.table_rows([noisy, apart, plain])}
    assert status["fastlm-fused"] == "ok; fwd+bwd < fwd within timing noise (p20-p80 ranges overlap)"
    assert status["fastlm"] == "ok; fwd+bwd < fwd with p20-p80 ranges apart: the load changed between the stages, rerun"
    assert status["eager"] == "ok"


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (3.518e13, "", "35.2 T"),
        (1_050_705_920, "B", "1.05 GB"),
        (32_768, "B", "32.8 kB"),
        (999.96, "", "1 k"),
        (0.25, "", "0.25"),
        (2.0, "B", "2 B"),
    ],
)
def test_si_keeps_three_digits(value, unit, text):
    assert si(value, unit) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.1369, "137 ms"), (8.4256e-6, "8.43 µs"), (999.96e-6, "1 ms"), (2.5, "2.5 s"), (3e-10, "0.3 ns")],
)
def test_si_seconds_picks_the_unit(seconds, text):
    assert si_seconds(seconds) == text


def test_present_columns_drop_what_no_row_measured():
    rows = [{"a": 1.0, "b": None, "c": float("nan")}, {"a": 2.0}]
    assert present_columns(rows, [("a", "A"), ("b", "B"), ("c", "C")]) == [("a", "A")]


def test_markdown_table_marks_missing_values():
    table = markdown_table([{"a": 1.23456, "b": None}], [("a", "A"), ("b", "B")])
    assert table.splitlines() == ["| A | B |", "| --- | --- |", "| 1.23 | — |"]


def test_bench_xent_cli_writes_records_and_report(tmp_path, capsys):
    assert main(["bench", "xent", "--batch", "4", "--vocab", "64,100", "--out", str(tmp_path)]) == 0
    records = read_records(tmp_path / "results" / "xent.jsonl")
    assert {(r["vocab"], r["implementation"]) for r in records} == {
        (v, impl.name) for v in (64, 100) for impl in xent.IMPLEMENTATIONS
    }
    by_name = {r["implementation"]: r for r in records if r["vocab"] == 64}
    on_gpu = torch.cuda.is_available()
    assert by_name["compile"]["status"] == ("ok" if on_gpu else "needs a GPU")
    assert by_name["fastlm"]["status"] == "ok" and by_name["fastlm"]["fwd_ms"] > 0
    gpu = torch.cuda.get_device_name() if on_gpu else "cpu"
    assert all(r["gpu"] == gpu and r["torch"] == torch.__version__ for r in records)
    report = (tmp_path / "reports" / "xent.md").read_text()
    assert "| 64 | fastlm |" in report
    assert (tmp_path / "reports" / "xent_fwd_bwd_ms.png").stat().st_size > 0
    ceilings = json.loads((tmp_path / "results" / "ceilings.jsonl").read_text().splitlines()[-1])
    assert ceilings["copy_gbps"] > 0 and ceilings["matmul_tflops"] > 0


def test_analyze_xent_prints_the_cost_model(capsys):
    assert main(["analyze", "xent", "--batch", "4096", "--vocab", "128256", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "1.05 GB" in out and "memory-bound" in out and "314 µs" in out  # 1,050,705,920 B; 313.7 µs


@pytest.mark.parametrize("argv", [["analyze", "xent", "--gpu", "v100"], ["bench", "xent", "--batch", "0"]])
def test_bad_flags_exit_with_one_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error: argument --" in capsys.readouterr().err


def test_xent_banner_names_the_batch_the_run_measures():
    cpu = torch.device("cpu")
    assert "at B=4096;" in xent.CrossEntropyBenchmark(batch=4096).note(cpu)
    assert "at B=128;" in xent.CrossEntropyBenchmark().note(cpu)  # the CPU default
    assert {case.batch for case in xent.CrossEntropyBenchmark(batch=4096).cases(cpu)} == {4096}


def test_a_bar_plot_lists_only_series_with_a_value(tmp_path, monkeypatch):
    from fastlm.utils import plots

    drawn = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, dpi: drawn.setdefault("fig", fig) and path)
    series = {"hf": [1.0, 2.0], "hf+fastlm": [1.5, None], "hf+liger": [None, None]}  # liger: not installed
    plots.grouped_bar_plot(tmp_path / "hf.png", ["a", "b"], series, ylabel="tokens/s", title="t")
    legend = drawn["fig"].axes[0].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == ["hf", "hf+fastlm"]
