"""`fastlm bench train`: both kernel sets train the same curve from the same start, and the
comparison writes its records and plot."""

import argparse

import pytest

from fastlm.bench import train_kernels
from fastlm.cli.train import add_kernel_comparison_arguments
from fastlm.utils.records import read_records


@pytest.mark.slow
def test_kernel_sets_train_alike(corpus_data, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="fastlm bench train")
    add_kernel_comparison_arguments(parser)
    args = parser.parse_args(
        [
            "--data",
            str(corpus_data),
            "--out",
            str(tmp_path),
            "--preset",
            "tiny",
            "--context",
            "16",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--eval-sequences",
            "2",
            "--log-every",
            "1",
        ]
    )
    assert train_kernels.run(args) == 0  # the fused kernels run under the (slow) Triton interpreter: 2 steps
    torch_run, fastlm_run = read_records(tmp_path / "results" / train_kernels.RESULTS_FILE)
    assert (torch_run["kernels"], fastlm_run["kernels"]) == ("torch", "fastlm")
    assert fastlm_run["final_loss"] == pytest.approx(torch_run["final_loss"], rel=1e-4)
    assert fastlm_run["eval_loss"] == pytest.approx(torch_run["eval_loss"], rel=1e-4)
    assert (tmp_path / "kernels.png").stat().st_size > 0 and (tmp_path / "fastlm" / "log.jsonl").exists()
    out = capsys.readouterr().out
    assert "fastlm kernels: " in out
    # each kernel set's first-call costs are paid before any timed run, in a folder that is gone after
    assert out.index("warming up the fastlm kernels") < out.index("\ntorch kernels: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fastlm", "kernels.png", "results", "torch"]
    args.kernels = ("torch", "torch")
    assert train_kernels.run(args) == 2
    assert "--kernels torch,torch names a kernel set twice" in capsys.readouterr().err
