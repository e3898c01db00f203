"""`fastlm bench model` on CPU: rows, timing summary, OOM rows, the command end to end."""

import json

import pytest
import torch

from fastlm.bench import model as model_bench
from fastlm.cli import main
from fastlm.model import ModelConfig

TINY = ModelConfig.preset("tiny", vocab_size=50, context_length=16)


def test_rows_put_eager_first_and_train_last():
    rows = model_bench.rows(("train", "fwd"), ("fp32", "bf16"), ("compile", "eager"))
    assert [(r.compile, r.precision, r.mode) for r in rows[:4]] == [
        ("eager", "fp32", "fwd"), ("eager", "fp32", "train"), ("eager", "bf16", "fwd"), ("eager", "bf16", "train")
    ]  # fmt: skip
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
    records = model_bench.measure_config(TINY, "tiny", rows, batch=1, warmup=0, steps=1, device=torch.device("cpu"))
    assert [r["status"] for r in records] == ["ok"] * 6
    assert compiled_modes == ["default", "reduce-overhead"]


def test_summary_reports_the_first_step_separately():
    times = [900.0, 10.0, 12.0, 11.0]
    summary = model_bench.summarize(times, warmup=1, tokens_per_step=1000)
    assert summary["first_step_ms"] == 900.0
    assert summary["median_ms"] == 11.0
    assert summary["tokens_per_s"] == pytest.approx(1000 / 0.011)
    with_first = model_bench.summarize(times, warmup=0, tokens_per_step=1000)  # --warmup 0: the first step is timed
    assert with_first["mean_ms"] == pytest.approx(233.25)
    assert with_first["std_ms"] > 400


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd", "train"])
def test_each_mode_measures_and_trains_only_in_train(mode):
    (record,) = model_bench.measure_config(TINY, "tiny", [model_bench.Row(mode, "fp32", "eager")], batch=2,
                                           warmup=1, steps=2, device=torch.device("cpu"))  # fmt: skip
    assert record["status"] == "ok" and record["mode"] == mode
    assert record["median_ms"] > 0 and record["tokens_per_s"] > 0
    assert record["steps"] == 2 and record["batch"] == 2


def test_out_of_memory_becomes_the_row_status(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(model_bench, "time_steps", out_of_memory)
    rows = [model_bench.Row("fwd", "fp32", "eager"), model_bench.Row("train", "fp32", "eager")]
    records = model_bench.measure_config(TINY, "tiny", rows, batch=1, warmup=0, steps=1, device=torch.device("cpu"))
    assert [r["status"] for r in records] == ["out of memory", "out of memory"]


def test_other_errors_are_not_hidden(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(model_bench, "time_steps", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        model_bench.measure_config(TINY, "tiny", [model_bench.Row("fwd", "fp32", "eager")], batch=1, warmup=0,
                                   steps=1, device=torch.device("cpu"))  # fmt: skip


def test_bench_model_command_writes_records_and_report(tmp_path):
    args = ["bench", "model", "--preset", "tiny", "--context", "16", "--batch", "1", "--mode", "fwd,train",
            "--precision", "fp32,bf16", "--kernels", "torch,fastlm", "--warmup", "0", "--steps", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "model.jsonl").read_text().splitlines()]
    assert len(records) == 8  # 2 kernel sets x 2 precisions x 2 modes
    assert {(r["attention"], r["loss"]) for r in records} == {("sdpa", "torch"), ("fastlm", "fastlm")}
    assert all(r["status"] == "ok" and r["warmup"] == 0 for r in records)
    report = (tmp_path / "reports" / "model.md").read_text()
    assert "| first step ms |" in report and "fastlm / fastlm / fastlm" in report


def test_custom_dimensions_and_bad_arguments(tmp_path, capsys):
    assert main(["bench", "model", "--d-model", "32", "--d-ff", "64", "--layers", "1", "--heads", "2",
                 "--context", "16", "--steps", "1", "--warmup", "0", "--precision", "fp32",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    assert "| custom |" in (tmp_path / "reports" / "model.md").read_text()
    assert main(["bench", "model", "--d-model", "32", "--out", str(tmp_path)]) == 2
    assert "missing --d-ff, --layers, --heads" in " ".join(capsys.readouterr().out.split())
    assert main(["bench", "model", "--d-model", "30", "--d-ff", "64", "--layers", "1", "--heads", "4",
                 "--out", str(tmp_path)]) == 2  # fmt: skip
    assert "divisible by num_heads" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["bench", "model", "--mode", "sideways"])
