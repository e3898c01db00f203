"""`fastlm bench host` on CPU: the host-time measurement, records, the report and the command line."""

import dataclasses
import time

import pytest
import torch

from fastlm.bench import host
from fastlm.bench.host_cases import CASES
from fastlm.bench.options import HOST_OPS
from fastlm.cli import build_parser, main
from fastlm.cli.bench import cmd_bench_host
from fastlm.harness.benchmark import Run
from fastlm.ops import launch
from fastlm.utils.records import append_records

CPU = torch.device("cpu")


def test_rounds_give_ordered_positive_spreads():
    times = host.measure_interleaved(
        {"a": host.HostCall(lambda _: sum(range(50))), "b": host.HostCall(lambda _: sum(range(500)))},
        CPU,
        calls=20,
        rounds=3,
        warmup=2,
    )
    for wall_rounds, cpu_rounds in times.values():
        assert len(wall_rounds) == len(cpu_rounds) == 3
        for spread in (host.summarize(wall_rounds), host.summarize(cpu_rounds)):
            assert 0 < spread.low <= spread.median <= spread.high


def test_setup_is_untimed_and_before_counts_in_wall_clock_only():
    # setup 10 ms, call 1 ms: were the setup timed, both numbers would pass 11 ms
    slow_setup = host.HostCall(lambda _: time.sleep(1e-3), setup=lambda: time.sleep(1e-2))
    wall_us, cpu_us = host.host_round(slow_setup, CPU, calls=5)
    assert 1000 <= wall_us < 6000 and 1000 <= cpu_us < 6000
    # before() 2 ms, call free: inside the back-to-back loop, outside the single-call timer
    slow_before = host.HostCall(lambda _: None, before=lambda: time.sleep(2e-3))
    wall_us, cpu_us = host.host_round(slow_before, CPU, calls=5)
    assert wall_us >= 2000 and cpu_us < 1000


def test_backward_direction_assigns_fresh_gradients():
    x = torch.randn(3, 4, requires_grad=True)
    calls = host.direction_calls(lambda x, _: (2 * x).sum(), (x, torch.arange(3)), torch.tensor(1.5))
    for direction in ("bwd", "fwd+bwd"):
        for _ in range(3):  # were gradients accumulated, x.grad would grow to 9
            call = calls[direction]
            state = call.setup()
            call.before()
            call.call(state)
            assert torch.equal(x.grad, torch.full((3, 4), 3.0))


def test_ratio_pairs_rounds():
    fastlm_record = {"status": "ok", "wall_us_rounds": [2.0, 4.0, 6.0]}
    pytorch_record = {"status": "ok", "wall_us_rounds": [1.0, 1.0, 3.0]}
    # per round 2, 4, 2: the ratio of the medians (4 / 1) would read 4
    assert host.ratio(fastlm_record, pytorch_record, "wall_us") == host.Spread(2.0, 2.0, 4.0)
    assert host.ratio(fastlm_record, {"status": "needs a GPU"}, "wall_us") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the reduced CPU run; GPUs compile the compile mode")
def test_tiny_cpu_run_writes_records_and_report(tmp_path, monkeypatch):
    # tiny shapes: under TRITON_INTERPRET=1 the fastlm kernels run in the interpreter
    small = {op: dataclasses.replace(CASES[op], shape=(4, 32)) for op in ("rms_norm", "weighted_sum")}
    monkeypatch.setattr(host, "CASES", small)
    benchmark = host.HostBenchmark(tuple(small), ("eager", "compile"), rounds=3, calls=3)
    steps = list(benchmark.measurements(Run(CPU, None)))
    assert [step.label for step in steps] == [
        "rms_norm eager",
        "rms_norm compile",
        "weighted_sum eager",
        "weighted_sum compile",
    ]
    records = [record for step in steps for record in step.records]
    assert {(r["op"], r["compile"], r["implementation"], r["direction"]) for r in records} == {
        (op, mode, impl, d)
        for op in ("rms_norm", "weighted_sum")
        for mode in ("eager", "compile")
        for impl in ("pytorch", "fastlm")
        for d in host.DIRECTIONS
    }
    expected_launch = "direct" if launch.DIRECT_LAUNCH else "triton"
    for r in records:
        assert r["gpu"] == "cpu" and r["torch"] == torch.__version__ and "git_sha" in r and "date" in r
        assert r["launch"] == expected_launch and r["shape"] == [4, 32] and r["dtype"] == "float32"
        if r["compile"] == "compile":
            assert r["status"] == "needs a GPU" and "wall_us" not in r
            continue
        assert r["status"] == "ok" and len(r["wall_us_rounds"]) == len(r["cpu_us_rounds"]) == 3
        assert 0 < r["wall_us_min"] <= r["wall_us"] <= r["wall_us_max"]
        assert 0 < r["cpu_us_min"] <= r["cpu_us"] <= r["cpu_us_max"]

    append_records(tmp_path / "results" / "host.jsonl", records)
    report = benchmark.render(tmp_path / "results", tmp_path / "reports")
    assert host.CPU_NOTE in report and host.LAUNCH_ON_CPU in report  # FASTLM_LAUNCH=triton: says why no comparison
    assert "| rms_norm | fwd+bwd |" in report and "| weighted_sum | bwd |" in report
    row = next(line for line in report.splitlines() if line.startswith("| weighted_sum | fwd+bwd |"))
    assert row.count("x (") == 2 and row.endswith("| ok |")  # wall and CPU ratios with their spreads
    assert "Not measured: needs a GPU." in report
    assert (tmp_path / "reports" / "host_fwd_bwd_ratio_eager.png").stat().st_size > 0
    assert not (tmp_path / "reports" / "host_fwd_bwd_ratio_compile.png").exists()


def _gpu_records(run_id: str, launch_path: str, fastlm_cpu_us: float) -> list[dict]:
    common = {
        "run_id": run_id,
        "launch": launch_path,
        "gpu": "GPU X",
        "torch": "2",
        "triton": "3",
        "git_sha": "a",
        "date": run_id,
        "dtype": "bfloat16",
        "calls": 200,
        "rounds": 3,
        "op": "rms_norm",
        "shape": [64, 1024],
        "baseline": "F.rms_norm",
        "compile": "eager",
        "status": "ok",
    }
    records = []
    for impl, us in (("pytorch", 10.0), ("fastlm", fastlm_cpu_us)):
        for direction in host.DIRECTIONS:
            times = {f"{m}{s}": us for m in ("wall_us", "cpu_us") for s in ("", "_min", "_max")}
            rounds = {"wall_us_rounds": [us] * 3, "cpu_us_rounds": [us] * 3}
            records.append({**common, "implementation": impl, "direction": direction, **times, **rounds})
    return records


def test_report_compares_launch_paths_and_checks_the_target(tmp_path):
    results = tmp_path / "results"
    append_records(results / "host.jsonl", _gpu_records("1-triton", "triton", 30.0))
    alone = host.HostBenchmark().render(results, tmp_path / "reports")
    assert host.LAUNCH_HOW.format(other="direct") in alone  # no direct run yet: how to get the comparison
    append_records(results / "host.jsonl", _gpu_records("2-direct", "direct", 12.0))
    report = host.HostBenchmark().render(results, tmp_path / "reports")
    assert host.CPU_NOTE not in report
    assert "| rms_norm | fwd+bwd | 10.0 (10.0–10.0) | 12.0 (12.0–12.0) | 1.20x (1.20–1.20) |" in report
    assert "within 1.5x of PyTorch's for 1 of 1 ops" in report
    assert "launch path direct vs triton" in report
    assert "| rms_norm | fwd+bwd | 12.0 (12.0–12.0) | 30.0 (30.0–30.0) |" in report


def test_the_command_line_offers_every_case():
    assert HOST_OPS == tuple(CASES)


def test_cli_parses_with_defaults_and_rejects_bad_values(capsys):
    args = build_parser().parse_args(["bench", "host"])
    assert (args.ops, args.compile, args.rounds, args.calls) == (None, ("eager",), None, None)
    assert args.func is cmd_bench_host
    argv = ["bench", "host", "--ops", "rms_norm,cross_entropy", "--compile", "eager,compile", "--rounds", "4"]
    args = build_parser().parse_args(argv)
    assert (args.ops, args.compile, args.rounds) == (("rms_norm", "cross_entropy"), ("eager", "compile"), 4)
    for bad, flag in (
        (["--rounds", "2"], "--rounds"),
        (["--ops", "softmax"], "--ops"),
        (["--compile", "cudagraphs"], "--compile"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "host", *bad])
        assert exit_info.value.code == 2
        assert f"error: argument {flag}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the reduced CPU run")
def test_command_writes_the_report(tmp_path, capsys):
    assert main(["bench", "host", "--ops", "weighted_sum", "--calls", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "host cost 1/1: weighted_sum eager" in out  # plain progress lines when not on a terminal
    assert "| weighted_sum | fwd+bwd |" in out
    report = (tmp_path / "reports" / "host.md").read_text()
    assert report.startswith("# Host cost per call") and "No GPU on this machine" in report
