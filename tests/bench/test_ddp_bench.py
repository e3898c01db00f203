"""`fastlm bench ddp`: the timeline arithmetic by hand, and a reduced run on 2 gloo ranks."""

import json

import pytest

from fastlm.bench.distributed.ddp_report import (
    ALLOCATOR_FIELDS,
    GLOO_NOTE,
    MEMORY_COLUMNS,
    compare_steps,
    render,
    round_range,
)
from fastlm.bench.distributed.options import ddp_variant
from fastlm.bench.distributed.timeline import Timeline, collective_intervals, intersection, length, merge
from fastlm.cli import main
from fastlm.distributed.wrappers import ParallelSpec


def test_merge_and_intersection_by_hand():
    assert merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert merge([(0, 1), (1.01, 2)], gap=0.02) == [(0, 2)]
    assert length([(0, 2), (1, 3), (5, 6)]) == 4
    # a = [0,2] u [3,4], b = [1,3.5]: overlap [1,2] + [3,3.5]
    assert intersection([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    assert intersection([(0, 1)], [(2, 3)]) == 0


def test_timeline_summary_by_hand():
    # two steps; NCCL 4 ms in all; backward windows (5, 11.5) and (25, 31) hold 1.5 + 1 ms of it
    timeline = Timeline(
        comm=[(10, 12), (30, 32)],
        compute={"forward": [(0, 5)], "backward": [(5, 11.5), (25, 31)], "optimizer": [(11.5, 12)]},
    )
    summary = timeline.summary(steps=2)
    assert summary["comm_ms"] == pytest.approx(2.0)
    assert summary["hidden_behind_backward"] == pytest.approx((1.5 + 1.0) / 4)
    assert summary["exposed_comm_ms"] == pytest.approx((4 - 2.5) / 2)
    assert Timeline([], {"forward": [(0, 1)]}).summary(1)["hidden_behind_backward"] is None


def test_timeline_usage_splits_a_step_into_compute_comm_and_idle():
    # 2 steps over 0-100 ms: compute 0-40 and 50-80, an all-reduce 30-60 (hidden 30-40 and 50-60,
    # exposed 40-50), nothing 80-90, a last kernel 90-100
    timeline = Timeline(comm=[(30, 60)], compute={"backward": [(0, 40), (50, 80)], "optimizer": [(90, 100)]})
    usage = timeline.usage(steps=2)
    assert usage["span_ms"] == pytest.approx(50) and usage["compute_ms"] == pytest.approx(40)
    assert usage["comm_ms"] == pytest.approx(15) and usage["exposed_comm_ms"] == pytest.approx(5)
    assert usage["idle_ms"] == pytest.approx(5) and usage["overlap"] == pytest.approx(2 / 3)
    assert Timeline([], {"forward": [(0, 1)]}).usage(1)["overlap"] is None  # nothing communicated
    with pytest.raises(ValueError, match="no GPU kernels"):
        Timeline([], {}).usage(1)


def test_backward_window_spans_idle_gaps_between_backward_kernels():
    # a launch-bound backward: kernels with gaps; the all-reduce in a gap is still hidden
    timeline = Timeline(comm=[(42, 44)], compute={"forward": [(30, 39)], "backward": [(40, 41), (45, 46)]})
    assert timeline.phase_windows("backward") == [(40, 46)]
    assert timeline.summary(1)["hidden_behind_backward"] == pytest.approx(1.0)


def test_collectives_start_when_the_last_rank_arrives():
    rank0 = [(10.0, 14.0), (20.0, 21.0)]
    rank1 = [(12.0, 14.1), (19.0, 21.0)]  # late for the first collective, early for the second
    assert collective_intervals([rank0, rank1]) == [(12.0, 14.0), (20.0, 21.0)]
    assert collective_intervals([rank0, rank1[:1]]) is None  # kernel counts differ: no pairing


def test_variant_names_parse_into_wrapper_specs():
    assert ddp_variant("bucketed-25").spec == ParallelSpec("bucketed", 25.0)
    assert ddp_variant("bucketed-25").name == "bucketed-25"  # records keep the name as given
    assert ddp_variant("no-sync").spec == ParallelSpec("none")  # the compute-only step
    assert ddp_variant("torch-ddp").spec == ParallelSpec("torch-ddp")  # PyTorch's own bucket size
    assert ddp_variant("bucketed-25-bf16").spec == ParallelSpec("bucketed", 25.0, "bf16")
    assert ddp_variant("torch-ddp-bf16").spec == ParallelSpec("torch-ddp", reduce_dtype="bf16")
    for bad in ("bucketed-0", "bucketed-x", "bucketed-inf", "ddp2", "none", "no-sync-bf16", "ddp-bf16-bf16", "-bf16"):
        with pytest.raises(ValueError, match="unknown variant"):
            ddp_variant(bad)


def test_command_on_gloo(tmp_path, capfd):
    argv = [
        "bench",
        "ddp",
        "--backend",
        "gloo",
        "--procs",
        "2",
        "--context",
        "16",
        "--vocab",
        "64",
        "--variants",
        "no-sync,flat,bucketed-0.01,torch-ddp,ddp-bf16",
        "--optimizers",
        "adamw,sharded,zero",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--profile-steps",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "results" / "ddp.jsonl").read_text().splitlines()]
    steps = {r["variant"]: r for r in records if r["kind"] == "step"}
    assert list(steps) == ["no-sync", "flat", "bucketed-0.01", "torch-ddp", "ddp-bf16"]
    assert all(r["median_ms"] > 0 and r["world"] == 2 and r["status"] == "ok" for r in steps.values())
    assert {r["precision"] for r in steps.values()} == {"fp32"}  # gloo's default: bf16 autocast is slow on a CPU
    assert all(len(r["round_median_ms"]) == 2 for r in steps.values())
    memory = {r["optimizer"]: r for r in records if r["kind"] == "memory"}
    assert memory["adamw"]["params_bytes"] == memory["adamw"]["grads_bytes"]
    assert memory["adamw"]["optimizer_state_bytes"] >= 2 * memory["adamw"]["params_bytes"]  # two moments
    for sharded in ("sharded", "zero"):  # each rank keeps about half of the state
        assert memory[sharded]["optimizer_state_bytes"] / memory["adamw"]["optimizer_state_bytes"] == pytest.approx(
            0.5, abs=0.1
        )
    assert (tmp_path / "traces" / "ddp_flat_x2.json.gz").stat().st_size > 0
    report = (tmp_path / "reports" / "ddp.md").read_text()
    assert "optimizer-state sharding" in report and "torch-ddp" in report
    assert GLOO_NOTE in report and "NCCL kernel ms" not in report and "round spread %" in report
    # the note names as not measured exactly the memory columns the table leaves out
    header = report.split("### Memory per rank")[1].split("\n| ")[1]
    shown = {name.strip() for name in header.split(" | ")}
    for field, name in MEMORY_COLUMNS:
        if field.endswith("_mb"):
            assert (name in shown) == (field not in ALLOCATOR_FIELDS), name
            assert name in GLOO_NOTE
    assert all(r["complete"] for r in records)  # written by the worker processes, marked at the end
    out = capfd.readouterr().out  # rank 0 of the worker processes reports each variant of each round
    for line in (
        "data-parallel steps, 2 processes (gloo, tiny): 5 variants x 2 rounds, then 3 memory rows",
        "data-parallel steps, 2 processes, round 2/2: torch-ddp ",
        "data-parallel steps, 2 processes: memory row of zero, ",
    ):
        assert line in out


def test_report_shows_each_rank_counts_latest_run(tmp_path):
    def step(run_id, world, variant, median_ms):
        return {
            "run_id": run_id,
            "kind": "step",
            "world": world,
            "variant": variant,
            "median_ms": median_ms,
            "gpu": "GPU",
            "backend": "nccl",
            "torch": "2",
            "git_sha": run_id,
            "date": "d",
            "preset": "xl",
            "context": 512,
            "batch": 4,
            "precision": "bf16",
            "rounds": 2,
            "steps": 20,
            "profile_steps": 2,
        }

    results = tmp_path / "results"
    results.mkdir()
    records = [
        step("old", 2, "ddp", 11.0),
        step("old", 2, "torch-ddp", 12.0),
        step("mid", 4, "ddp", 99.0),
        step("new", 4, "ddp", 33.0),
        step("new", 8, "ddp", 44.0),
    ]
    (results / "ddp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = render(results, tmp_path / "reports")
    assert report.index("## 2 ranks") < report.index("## 4, 8 ranks")
    assert "git old" in report and "git new" in report and "git mid" not in report
    assert "| 11 |" in report and "| 33 |" in report and "| 44 |" in report and "| 99 |" not in report
    for tag in ("2", "4-8"):
        assert (tmp_path / "reports" / f"ddp_step_ms_x{tag}.png").stat().st_size > 0


def test_differences_within_the_round_spread_are_no_comparison():
    reference = {"median_ms": 100.0, "round_median_ms": [90.0, 110.0]}
    overlapping = {"median_ms": 80.0, "round_median_ms": [60.0, 95.0]}  # 20% faster by median, but noise
    apart = {"median_ms": 50.0, "round_median_ms": [45.0, 55.0]}
    assert compare_steps(overlapping, reference) == "within noise"
    assert compare_steps(apart, reference) == pytest.approx(0.5)
    assert compare_steps(reference, reference) == 1.0
    assert compare_steps({"median_ms": 80.0, "round_median_ms": [80.0]}, reference) == pytest.approx(0.8)  # 1 round
    assert round_range(overlapping) == (60.0, 95.0) and round_range({"round_median_ms": [1.0]}) is None


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--variants", "ddp,fastest"])
    assert "unknown variant 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "ddp", "--optimizers", "sgd"])
