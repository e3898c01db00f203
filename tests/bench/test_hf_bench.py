"""`fastlm bench hf` on CPU: the shapes' parameter counts, the command end to end with its records,
ratios and missing baselines, and its one-line errors."""

import json
import re

import pytest
import torch

from fastlm.cli import main

pytest.importorskip("transformers")

from fastlm.bench.hf import HFShape, build_model  # noqa: E402
from fastlm.bench.options import HF_FAMILIES  # noqa: E402


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_parameter_counts_match_the_built_model(family):
    # MFU and the memory estimate use these counts: they must be the model's
    shape = HFShape.of(family, "tiny", context_length=16, num_layers=3)
    model = build_model(shape)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.config.num_hidden_layers == 3 and model.config.model_type == family


def test_bench_hf_command_measures_every_patch_in_one_run(tmp_path, capsys):
    args = [
        "bench",
        "hf",
        "--family",
        "llama",
        "--size",
        "tiny",
        "--seq",
        "16",
        "--batch",
        "1",
        "--compile",
        "eager",
        "--warmup",
        "0",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    progress = [tuple(map(int, m)) for m in re.findall(r"hf (\d+)/(\d+)", out)]
    assert progress and progress[-1][0] == progress[-1][1], progress  # the count includes every step
    assert re.search(r"hf \d+/\d+: tiny hf\+fastlm train fp32 eager round 1/2", out)
    records = [json.loads(line) for line in (tmp_path / "results" / "hf.jsonl").read_text().splitlines()]
    by_name = {r["implementation"]: r for r in records}
    assert set(by_name) == {"hf", "hf+fastlm", "hf+liger"}
    for name in ("hf", "hf+fastlm"):
        record = by_name[name]
        assert record["status"] == "ok" and len(record["round_median_ms"]) == 2
        assert record["schedule"] == "interleaved" and record["context_length"] == 16
        assert record["precision"] == "fp32"  # the default without a GPU
    liger = by_name["hf+liger"]
    assert liger["status"] == "ok" or liger["status"] == "missing: liger-kernel is not installed"
    report = (tmp_path / "reports" / "hf.md").read_text()
    fastlm_row = next(line for line in report.splitlines() if "| hf+fastlm |" in line)
    assert fastlm_row.count("x") >= 1  # its tokens/s ratio against the unpatched model


def test_the_fp8_patch_runs_on_request(tmp_path):
    args = ["bench", "hf", "--family", "llama", "--size", "tiny", "--seq", "16", "--batch", "1", "--compile", "eager"]
    options = ["--patches", "fastlm-fp8", "--warmup", "0", "--steps", "1", "--rounds", "1", "--out", str(tmp_path)]
    assert main([*args, *options]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "results" / "hf.jsonl").read_text().splitlines()]
    assert record["implementation"] == "hf+fastlm+fp8" and record["status"] == "ok"


def test_bench_hf_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "hf", "--size", "tiny", "--heads", "6", "--kv-heads", "4", "--out", str(tmp_path)]) == 2
    assert "query heads (6) must be a multiple of the key/value heads (4)" in capsys.readouterr().err
    for bad in (["--size", "2b"], ["--patches", "none,apex"], ["--family", "gpt2"]):
        with pytest.raises(SystemExit):
            main(["bench", "hf", *bad, "--out", str(tmp_path)])
        err = capsys.readouterr().err
        assert "invalid choice" in err or "unknown patch 'apex'" in err


def test_a_patch_that_fails_becomes_its_rows_status(monkeypatch, tmp_path):
    # a third-party patch that cannot run a row (Liger's loss under torch.compile, say) must not end
    # the run: its rows say why, the other patches' rows are measured
    from fastlm.bench import hf
    from fastlm.harness.benchmark import Implementation

    def broken(shape):
        model = build_model(shape)
        model.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("cannot trace addmm\nmore"))
        return model

    monkeypatch.setitem(hf.IMPLEMENTATIONS, "liger", Implementation("hf+liger", broken))
    monkeypatch.setattr(hf, "missing_patch", lambda patch: None)
    benchmark = hf.HFBenchmark(
        (HFShape.of("llama", "tiny", 16),),
        ("none", "liger"),
        (hf.Row("train", "fp32", "eager"),),
        batch=1,
        warmup=0,
        steps=1,
        rounds=2,
    )
    from fastlm.harness.runner import run_benchmark

    report = run_benchmark(benchmark, tmp_path, torch.device("cpu")).read_text()
    records = [json.loads(line) for line in (tmp_path / "results" / "hf.jsonl").read_text().splitlines()]
    assert [(r["implementation"], r["status"]) for r in records] == [
        ("hf", "ok"),
        ("hf+liger", "error: cannot trace addmm"),
    ]
    assert "error: cannot trace addmm" in report


@pytest.mark.parametrize("on_gpu", [False, True])
def test_fastlm_report_has_the_hf_and_swiglu_sections(on_gpu):
    from fastlm.cli.report import report_sections

    headings = [heading for _, heading, _ in report_sections(on_gpu)]
    hf = next(benchmark for benchmark, heading, _ in report_sections(on_gpu) if heading.startswith("Hugging Face"))
    assert "SwiGLU" in headings
    assert hf.shapes[0].num_layers == (4 if on_gpu else 2) and len(hf.patches) == 3


def test_a_cpu_run_whose_models_and_activations_exceed_the_host_is_refused_before_building(monkeypatch, tmp_path):
    """Beyond the command's check of the models' training state: the estimate with activations,
    before the run starts (without the refusal it would train the two tiny models and return)."""
    from fastlm.bench import hf
    from fastlm.harness.runner import run_benchmark
    from fastlm.utils import host_memory
    from fastlm.utils.errors import UserError

    monkeypatch.setattr(host_memory, "host_memory", lambda: 10**6)  # not even a tiny model fits 0.5 MB
    benchmark = hf.HFBenchmark(
        (HFShape.of("llama", "tiny", 16),), ("none", "fastlm"), (hf.Row("train", "fp32", "eager"),), 1, 0, 1
    )
    expected = r"the tiny model alone at batch 1 needs .* use a smaller --size, --batch or --seq"
    with pytest.raises(UserError, match=expected):
        run_benchmark(benchmark, tmp_path, torch.device("cpu"))
