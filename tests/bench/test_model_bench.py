"""`fastlm bench model` on CPU: rows, timing summary, rounds and their schedule, OOM rows, the report
with its spreads and ratios, the command end to end."""

import dataclasses
import json

import pytest
import torch

from fastlm.bench import model as model_bench
from fastlm.bench import model_report
from fastlm.cli import main
from fastlm.harness.runner import run_benchmark
from fastlm.model import ModelConfig
from fastlm.utils import host_memory
from fastlm.utils.errors import UserError

TINY = ModelConfig.preset("tiny", vocab_size=50, context_length=16)
HF = model_bench.IMPLEMENTATIONS[1]


def measure(subjects, rows, *, batch=1, warmup=1, steps=3, **kwargs) -> list[dict]:
    """The records of every step of `measure_rounds` on the CPU."""
    steps_taken = model_bench.measure_rounds(
        subjects, rows, batch=batch, warmup=warmup, steps=steps, device=torch.device("cpu"), **kwargs
    )
    return [record for step in steps_taken for record in step.records]


def measure_config(config, rows, **kwargs) -> list[dict]:
    return measure([model_bench.Subject("tiny", config)], rows, rounds=1, **kwargs)


def test_rows_put_eager_first_and_train_last():
    rows = model_bench.rows(("train", "fwd"), ("fp32", "bf16"), ("compile", "eager"))
    assert [(r.compile, r.precision, r.mode) for r in rows[:4]] == [
        ("eager", "fp32", "fwd"),
        ("eager", "fp32", "train"),
        ("eager", "bf16", "fwd"),
        ("eager", "bf16", "train"),
    ]
    assert len(rows) == 8


def test_each_compile_mode_compiles_once_in_its_own_mode(monkeypatch):
    compiled_modes = []
    real_compile = torch.compile

    def recording_compile(model, mode=None, **kwargs):
        compiled_modes.append(mode)
        return real_compile(model, mode=mode, backend="eager", **kwargs)  # no code generation: fast

    monkeypatch.setattr(torch, "compile", recording_compile)
    rows = model_bench.rows(("fwd", "train"), ("fp32",), ("cudagraphs", "eager", "compile"))
    assert [r.compile for r in rows] == ["eager", "eager", "compile", "compile", "cudagraphs", "cudagraphs"]
    records = measure_config(TINY, rows, warmup=0, steps=1)
    assert [r["status"] for r in records] == ["ok"] * 6
    assert compiled_modes == ["default", "reduce-overhead"]


def test_summary_reports_the_first_step_separately():
    times = [900.0, 10.0, 12.0, 11.0]
    summary = model_bench.summarize_rounds([times], warmup=1, tokens_per_step=1000)
    assert summary["first_step_ms"] == 900.0
    assert summary["median_ms"] == 11.0
    assert summary["tokens_per_s"] == pytest.approx(1000 / 0.011)
    # --warmup 0: the first step is timed
    with_first = model_bench.summarize_rounds([times], warmup=0, tokens_per_step=1000)
    assert with_first["mean_ms"] == pytest.approx(233.25)
    assert with_first["std_ms"] > 400


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd", "train"])
def test_each_mode_measures_and_trains_only_in_train(mode):
    (record,) = measure_config(TINY, [model_bench.Row(mode, "fp32", "eager")], batch=2, warmup=1, steps=2)
    assert record["status"] == "ok" and record["mode"] == mode
    assert record["median_ms"] > 0 and record["tokens_per_s"] > 0
    assert record["steps"] == 2 and record["batch"] == 2


def test_bf16_weights_rows_store_matmul_weights_in_bf16_for_the_round(monkeypatch):
    """A bf16-weights row steps with bf16 matmul weights (fp32 masters in fastlm's AdamW when it
    trains); the next row finds its model in fp32 again."""
    from fastlm.layers.linear import linear_weights

    seen = []  # per round: the dtypes of the matmul weights and their gradients while it steps
    real_make_step = model_bench.make_step

    def recording_make_step(loss_fn, model, *args):
        step = real_make_step(loss_fn, model, *args)
        seen.append(set())

        def recorded_step():
            step()
            weights = linear_weights(model)
            seen[-1].update({p.dtype for p in weights} | {p.grad.dtype for p in weights if p.grad is not None})

        return recorded_step

    monkeypatch.setattr(model_bench, "make_step", recording_make_step)
    rows = [model_bench.Row("train", "bf16-weights", "eager"), model_bench.Row("train", "bf16", "eager")]
    records = measure_config(TINY, rows, warmup=0, steps=2)
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert seen == [{torch.bfloat16}, {torch.float32}]


def test_bf16_weights_optimizer_keeps_fp32_masters():
    from fastlm.harness.steps import make_optimizer, weights_stored_for
    from fastlm.layers.linear import linear_weights
    from fastlm.model import TransformerLM
    from fastlm.optim import AdamW

    model = TransformerLM(TINY)
    with weights_stored_for(model, "bf16-weights"):
        optimizer = make_optimizer(model, "bf16-weights")
        assert isinstance(optimizer, AdamW)
        for weight in linear_weights(model):
            assert weight.dtype == torch.bfloat16
            assert torch.equal(optimizer.state[weight]["master"], weight.float())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_out_of_memory_becomes_the_row_status(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(model_bench, "time_steps", out_of_memory)
    rows = [model_bench.Row("fwd", "fp32", "eager"), model_bench.Row("train", "fp32", "eager")]
    records = measure_config(TINY, rows, warmup=0, steps=1)
    assert [r["status"] for r in records] == ["out of memory", "out of memory"]


def test_other_errors_are_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(model_bench, "time_steps", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure_config(TINY, [model_bench.Row("fwd", "fp32", "eager")], warmup=0, steps=1)


@pytest.mark.slow
def test_bench_model_command_writes_records_and_report(tmp_path):
    args = [
        "bench",
        "model",
        "--preset",
        "tiny",
        "--context",
        "16",
        "--batch",
        "1",
        "--mode",
        "fwd,train",
        "--precision",
        "fp32,bf16",
        "--kernels",
        "torch,fastlm",
        "--warmup",
        "0",
        "--steps",
        "1",  # each fastlm row steps through the interpreter; rounds of several steps: below
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "model.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 2 kernel sets x 2 precisions x 2 modes
    assert {(r["attention"], r["loss"]) for r in records} == {("sdpa", "torch"), ("fastlm", "fastlm")}
    assert all(r["status"] == "ok" and r["warmup"] == 0 for r in records)
    report = (tmp_path / "reports" / "model.md").read_text()
    assert "| first step ms |" in report and "fastlm / auto / auto / auto / fastlm" in report


def test_custom_dimensions_and_bad_arguments(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "model",
                "--d-model",
                "32",
                "--d-ff",
                "64",
                "--layers",
                "1",
                "--heads",
                "2",
                "--context",
                "16",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--precision",
                "fp32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "| custom |" in (tmp_path / "reports" / "model.md").read_text()
    assert main(["bench", "model", "--heads", "3", "--out", str(tmp_path)]) == 2  # the rest: the preset's
    assert "--d-model (64) must be divisible by --heads (3)" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                "model",
                "--d-model",
                "30",
                "--d-ff",
                "64",
                "--layers",
                "1",
                "--heads",
                "4",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "--d-model (30) must be divisible by --heads (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "model", "--mode", "sideways"])


# --- rounds -------------------------------------------------------------------------------------

TORCH_KERNELS, FASTLM_KERNELS = TINY.with_kernels("torch"), TINY.with_kernels("fastlm")


def fake_rounds(monkeypatch, medians_ms: list[float], raise_at: int | None = None) -> list:
    """time_steps returns, call by call, a round with warm-up step 999 ms and timed steps around the
    next median of ``medians_ms`` (median m: m - 1, m, m + 1); call ``raise_at`` runs out of memory.
    Returns the list of calls made, as (call index, step closure)."""
    calls = []

    def fake_time_steps(step, warmup, steps, device):
        assert (warmup, steps) == (1, 3)
        calls.append(step)
        if len(calls) - 1 == raise_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        median = medians_ms[len(calls) - 1]
        return [999.0, median + 1, median - 1, median]

    monkeypatch.setattr(model_bench, "time_steps", fake_time_steps)
    return calls


def test_interleaved_rounds_visit_every_configuration_before_the_next_round(monkeypatch):
    subjects = [model_bench.Subject("tiny", TORCH_KERNELS), model_bench.Subject("tiny", FASTLM_KERNELS)]
    rows = [model_bench.Row("fwd", "fp32", "eager"), model_bench.Row("train", "fp32", "eager")]
    # call order, interleaved: round 1 of (torch fwd, torch train, fastlm fwd, fastlm train), then round 2
    fake_rounds(monkeypatch, [10, 20, 30, 40, 12, 18, 33, 44])
    records = measure(subjects, rows, rounds=2, interleave=True)
    assert [(r["attention"], r["mode"], r["round_median_ms"]) for r in records] == [
        ("sdpa", "fwd", [10, 12]),
        ("sdpa", "train", [20, 18]),
        ("fastlm", "fwd", [30, 33]),
        ("fastlm", "train", [40, 44]),
    ]
    assert all(r["rounds"] == 2 and r["schedule"] == "interleaved" for r in records)
    # back to back: the two rounds of each configuration follow each other
    fake_rounds(monkeypatch, [10, 12, 20, 18, 30, 33, 40, 44])
    again = measure(subjects, rows, rounds=2, interleave=False)
    assert [r["round_median_ms"] for r in again] == [r["round_median_ms"] for r in records]
    assert {r["schedule"] for r in again} == {"back to back"}


def test_record_carries_round_medians_their_median_and_spread(monkeypatch):
    fake_rounds(monkeypatch, [104.0, 98.9, 101.8])
    (record,) = measure(
        [model_bench.Subject("tiny", TORCH_KERNELS)], [model_bench.Row("train", "fp32", "eager")], rounds=3
    )
    assert record["round_median_ms"] == [104.0, 98.9, 101.8]
    assert record["median_ms"] == 101.8
    assert (record["median_min_ms"], record["median_max_ms"]) == (98.9, 104.0)
    assert record["median_min_ms"] <= record["median_ms"] <= record["median_max_ms"]
    assert record["first_step_ms"] == 999.0  # round 1's first step, never a timed one
    assert record["tokens_per_s"] == pytest.approx(16 / 0.1018)  # batch 1 x context 16, from the median
    assert 97.9 <= record["p20_ms"] < record["p80_ms"] <= 105.0  # pooled timed steps, warm-up excluded


def test_models_are_built_and_compiled_once_across_rounds(monkeypatch):
    compiled_modes, builds = [], []
    real_compile, real_model = torch.compile, model_bench.TransformerLM

    def recording_compile(model, mode=None, **kwargs):
        compiled_modes.append(mode)
        return real_compile(model, mode=mode, backend="eager", **kwargs)

    def recording_model(config):
        builds.append(config.kernels.attention)
        return real_model(config)

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(model_bench, "TransformerLM", recording_model)
    small = dataclasses.replace(TORCH_KERNELS, num_layers=1)
    naive = small.with_kernels(attention="naive")  # a second model, still plain PyTorch: quick on CPU
    subjects = [model_bench.Subject("tiny", small), model_bench.Subject("tiny", naive)]
    rows = model_bench.rows(("fwd",), ("fp32",), ("eager", "compile"))
    records = measure(subjects, rows, warmup=0, steps=1, rounds=2, interleave=True)
    assert [len(r["round_median_ms"]) for r in records] == [2] * 4
    assert builds == ["sdpa", "naive"] and compiled_modes == ["default", "default"]  # one model each, compiled once


def test_out_of_memory_in_a_later_round_ends_only_that_configuration(monkeypatch):
    rows = [model_bench.Row("fwd", "fp32", "eager"), model_bench.Row("train", "fp32", "eager")]
    calls = fake_rounds(monkeypatch, [10, 20, 11, 0, 12], raise_at=3)  # round 2 of train runs out of memory
    records = measure([model_bench.Subject("tiny", TORCH_KERNELS)], rows, rounds=3, interleave=True)
    assert [r["status"] for r in records] == ["ok", "out of memory"]
    assert records[0]["round_median_ms"] == [10, 11, 12] and len(calls) == 5  # train is not retried


def test_the_schedule_falls_back_to_back_to_back_when_the_models_do_not_fit():
    xl = ModelConfig.preset("xl")
    subjects = [model_bench.Subject("xl", xl.with_kernels(kernels)) for kernels in ("torch", "fastlm")]
    subjects.append(model_bench.Subject("xl", xl, HF))
    rows = model_bench.rows(("train",), ("bf16",), ("eager", "compile", "cudagraphs"))
    h100 = int(0.9 * 85_029_158_912)  # the budget on an H100 80GB HBM3: 90% of its bytes
    # measured alone: xl trains in 33.6 GiB at batch 4 (H100, benchmarks/results/model.jsonl); the estimate is above
    alone = model_bench.model_memory_estimate(xl, rows[:1], 4)
    assert 33.6 * 2**30 < alone < 1.3 * 33.6 * 2**30
    assert model_bench.choose_schedule(subjects, rows, 4, h100, None)[0] == "interleaved"
    schedule, why = model_bench.choose_schedule(subjects, rows, 16, h100, None)
    assert schedule == "back to back" and "of the 77 GB a run may use" in why
    assert model_bench.choose_schedule(subjects, rows, 16, h100, True)[0] == "interleaved"  # --interleave wins
    assert model_bench.choose_schedule(subjects, rows, 4, None, None)[0] == "interleaved"  # no budget


def test_a_cpu_run_that_would_not_fit_the_host_is_refused_before_building(monkeypatch, tmp_path, capsys):
    def benchmark(configs, batch, interleave=None):
        rows = model_bench.rows(("train",), ("fp32",), ("eager",))
        return model_bench.ModelBenchmark(tuple(configs), tuple(rows), batch, 1, 1, interleave=interleave)

    monkeypatch.setattr(host_memory, "host_memory", lambda: 64 * 10**9)
    built = []
    monkeypatch.setattr(model_bench, "TransformerLM", lambda config: built.append(config))
    expected = r"the xl model alone at batch 4 needs about \d+\.\d GB, more than half of the 64.0 GB here"
    with pytest.raises(UserError, match=expected):
        run_benchmark(benchmark([("xl", ModelConfig.preset("xl"))], 4), tmp_path, torch.device("cpu"))
    assert capsys.readouterr().out == ""  # refused before the run's notes and progress
    tiny = [("tiny", TORCH_KERNELS), ("tiny", FASTLM_KERNELS)]
    monkeypatch.setattr(host_memory, "host_memory", lambda: 10**6)  # not even one tiny model fits 0.5 MB
    with pytest.raises(UserError, match="every model of the run kept at batch 2 needs .*, or --no-interleave$"):
        benchmark(tiny, 2, interleave=True).preflight(torch.device("cpu"))
    with pytest.raises(UserError, match="the tiny model alone at batch 2"):  # auto: back to back, still too big
        benchmark(tiny, 2).preflight(torch.device("cpu"))
    assert built == []


def test_report_shows_median_spread_and_paired_ratios(monkeypatch, tmp_path):
    def hf_stand_in(config):  # transformers is optional: the steps are faked, only the record matters
        return model_bench.TransformerLM(config)

    monkeypatch.setattr(model_bench, "build_hf_llama", hf_stand_in)
    # each round measures our model with torch kernels, HF Llama (once per shape), ours with fastlm kernels
    fake_rounds(monkeypatch, [100.0, 120.0, 90.0, 110.0, 130.0, 100.0])
    benchmark = model_bench.ModelBenchmark(
        (("tiny", TORCH_KERNELS), ("tiny", FASTLM_KERNELS)),
        (model_bench.Row("train", "fp32", "eager"),),
        batch=1,
        warmup=1,
        steps=3,
        rounds=2,
        hf=True,
    )
    report = run_benchmark(benchmark, tmp_path, torch.device("cpu")).read_text()
    assert "1 warm-up + 3 timed steps per row and round, 2 rounds interleaved" in report
    lines = report.splitlines()
    torch_row, hf_row, fastlm_row = [line for line in lines if line.startswith(("| fastlm", "| hf-llama"))]
    # torch kernels: round medians 100 and 110 -> median 105, spread 100-110; tokens/s 16 / 0.105 s
    assert "| 105.0 (100.0-110.0) |" in torch_row and "| 152.4 (145.5-160.0) |" in torch_row
    assert "| 125.0 (120.0-130.0) |" in hf_row and "| 95.0 (90.0-100.0) |" in fastlm_row
    torch_ratios, hf_ratios, fastlm_ratios = [line for line in lines if line.startswith("| tiny |")]
    # per-round ratios, fastlm over torch kernels: 100/90, 110/100; over HF: 120/90, 130/100
    assert fastlm_ratios.endswith("| 1.11x (1.1-1.11) | 1.32x (1.3-1.33) |")
    assert torch_ratios.endswith("| — | 1.19x (1.18-1.2) |")  # against HF: 120/100, 130/110
    assert "HF Llama" in hf_ratios and hf_ratios.endswith("| — | — |")


def test_unpaired_ratio_spread_takes_the_extremes():
    ours = {"schedule": "back to back", "round_median_ms": [90.0, 100.0, 95.0], "median_ms": 95.0}
    theirs = {"schedule": "back to back", "round_median_ms": [100.0, 110.0, 105.0], "median_ms": 105.0}
    assert model_report.speed_ratio(ours, theirs) == pytest.approx((105 / 95, 100 / 100, 110 / 90))
    paired = model_report.speed_ratio({**ours, "schedule": "interleaved"}, {**theirs, "schedule": "interleaved"})
    assert paired == pytest.approx((105 / 95, 110 / 100, 100 / 90))


def test_bench_model_command_runs_rounds(tmp_path, capsys):
    args = [
        "bench",
        "model",
        "--preset",
        "tiny",
        "--context",
        "16",
        "--batch",
        "1",
        "--mode",
        "fwd",
        "--precision",
        "fp32",
        "--compile",
        "eager",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--no-interleave",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "results" / "model.jsonl").read_text().splitlines()]
    assert record["rounds"] == 2 and len(record["round_median_ms"]) == 2
    assert record["schedule"] == "back to back" and record["schedule_reason"] == "--no-interleave"
    assert min(record["round_median_ms"]) <= record["median_ms"] <= max(record["round_median_ms"])
    assert "2 rounds back to back" in (tmp_path / "reports" / "model.md").read_text()
    with pytest.raises(SystemExit):
        main(["bench", "model", "--rounds", "0"])
