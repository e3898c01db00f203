"""`fastlm bench moe` on CPU: the FLOP count, the routings, the option vocabulary and a reduced run."""

import json

import pytest
import torch

from fastlm.bench import moe
from fastlm.bench.bandwidth import CPU_NOTE
from fastlm.bench.options import MOE_LAYERS
from fastlm.cli import main


def test_layers_and_flops_by_hand():
    assert tuple(moe.LAYERS) == MOE_LAYERS  # the parser's choices, kept without torch
    case = moe.Case(moe.LAYERS["qwen3-30b-a3b"], 16384, "uniform")
    # per pair: gate and up (2 * 2 D I), down (2 D I); backward twice the forward
    assert moe.active_flops(case, "fwd") == 16384 * 8 * 6 * 2048 * 768
    assert moe.active_flops(case, "fwd_bwd") == 3 * moe.active_flops(case, "fwd")


@pytest.mark.parametrize("layer", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_skewed_routing_gives_one_expert_four_times_the_mean_load(layer):
    shape = moe.LAYERS[layer]
    index, weights = moe.routes(moe.Case(shape, 4096, "skewed"), torch.device("cpu"), torch.Generator().manual_seed(0))
    load = torch.bincount(index.flatten(), minlength=shape.experts).float()
    mean = 4096 * shape.top_k / shape.experts
    assert load[0] == pytest.approx(moe.SKEW * mean, rel=0.05) and load[1:].max() < 2 * mean
    assert (index.sort(dim=1).values.diff(dim=1) > 0).all()  # K distinct experts per token
    assert weights.requires_grad and torch.allclose(weights.float().sum(dim=1), torch.ones(4096), atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reduced CPU run; GPUs run the full benchmark")
def test_command_runs_on_cpu(tmp_path, capsys):
    assert main(["bench", "moe", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(CPU_NOTE)
    records = [json.loads(line) for line in (tmp_path / "results" / "moe.jsonl").read_text().splitlines()]
    ok = {(r["routing"], r["implementation"]) for r in records if r["status"] == "ok"}
    assert ok == {(routing, name) for routing in moe.ROUTINGS for name in ("hf eager", "hf grouped_mm", "fastlm")}
    assert {r["status"] for r in records if r["implementation"] == "hf grouped_mm compiled"} == {"needs a GPU"}
    assert all(r["fwd_bwd_tflops"] > 0 for r in records if r["status"] == "ok")
    report = (tmp_path / "reports" / "moe.md").read_text()
    assert CPU_NOTE in report and "fwd+bwd vs hf grouped_mm" in report
