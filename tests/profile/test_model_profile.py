"""`fastlm profile model|memory` and `analyze memory` on CPU: attribution, timelines, commands."""

import json
from types import SimpleNamespace

import pytest

from fastlm.cli import main
from fastlm.profile import memory
from fastlm.profile.kernels import OUTSIDE, category_shares, kernel_category, summarize_kernels


def _event(name, start, end, kernels=()):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
    )


def test_kernels_go_to_the_innermost_range_containing_their_launch():
    events = [
        _event("forward", 0, 100),
        _event("attention/softmax", 40, 60),
        _event("backward", 200, 300),
        _event("cudaLaunchKernel", 10, 11, [("nvjet_sm90_tst_gemm", 5.0)]),
        _event("cudaLaunchKernel", 50, 51, [("softmax_warp_forward", 3.0)]),
        _event("cudaLaunchKernel", 250, 251, [("nvjet_sm90_tst_gemm", 7.0), ("elementwise_kernel", 1.0)]),
        _event("cudaLaunchKernel", 400, 401, [("elementwise_kernel", 2.0)]),
    ]
    summary, on_gpu = summarize_kernels(events, {"forward", "backward", "attention/softmax"})
    assert on_gpu
    assert summary["forward"]["nvjet_sm90_tst_gemm"].total_us == 5.0
    assert summary["attention/softmax"]["softmax_warp_forward"].calls == 1
    assert summary["backward"]["nvjet_sm90_tst_gemm"].total_us == 7.0
    assert summary[OUTSIDE]["elementwise_kernel"].total_us == 2.0
    shares = category_shares(summary["backward"])
    assert shares["matmul"] == pytest.approx(7 / 8) and shares["other"] == pytest.approx(1 / 8)


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("nvjet_sm90_tst_96x128_64x7_2x1_v_bz_TNN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16", "matmul"),
        ("_flash_forward_kernel", "attention"),
        ("triton_poi_fused_add_0", "other"),
        ("aten::mm", "matmul"),
    ],
)
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_snapshot_timeline_counts_allocations_made_before_recording():
    frames = [{"filename": "/x/fastlm/model/transformer.py", "line": 42, "name": "forward"}]
    snapshot = {
        "segments": [
            {
                "device": 0,
                "blocks": [
                    {"size": 100, "state": "active_allocated"},
                    {"size": 30, "state": "active_allocated"},
                    {"size": 50, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 30, "time_us": 1000, "frames": frames},
                {"action": "alloc", "addr": 2, "size": 70, "time_us": 2000, "frames": frames},
                {"action": "free_requested", "addr": 2, "size": 70, "time_us": 2500},
                {"action": "free_completed", "addr": 2, "size": 70, "time_us": 3000},
            ]
        ],
    }
    timeline = memory.timeline_from_snapshot(snapshot, 0)
    assert timeline.active_bytes == [100, 130, 200, 130]  # 100 B were there before the step
    assert timeline.times_ms == [0.0, 0.0, 1.0, 2.0]
    assert timeline.peak_bytes == 200
    assert timeline.largest_at_peak[0] == (100, "allocated before the step (parameters, optimizer state, ...)")
    assert timeline.largest_at_peak[1] == (70, "forward (transformer.py:42)")


def test_profile_model_command(tmp_path, capsys):
    assert (
        main(
            [
                "profile",
                "model",
                "--context",
                "32",
                "--batch",
                "2",
                "--warmup",
                "1",
                "--steps",
                "1",
                "--precision",
                "fp32",
                "--timing-steps",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profiling tiny ")]
    assert [line.split(":")[0] for line in progress] == [f"profiling tiny {i}/6" for i in range(1, 7)]
    records = [json.loads(line) for line in (tmp_path / "results" / "profile_model.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["inference", "train"]
    train = records[1]
    assert train["attention"] == "naive"  # the path with ranges inside attention
    assert all(train["range_ms_per_step"][name] > 0 for name in ("forward", "backward", "optimizer"))
    assert [s["stage"] for s in train["attention_stages"]] == ["scores", "mask", "softmax", "output"]
    assert records[0]["range_ms_per_step"]["backward"] == 0
    assert (tmp_path / "traces" / "profile_model_train.trace.json").stat().st_size > 0
    report = (tmp_path / "reports" / "profile_model.md").read_text()
    assert "## Matrix multiplies vs other kernels" in report and "attention stages" in report
    # the tool's cost comes with the plain steps' spread, below which it is noise
    assert all(r["plain_spread_percent"] >= 0 for r in records)
    assert "plain rounds' spread, %" in report and "is noise" in report


def test_profile_memory_and_analyze_memory_commands(tmp_path, capfd):
    assert (
        main(
            [
                "profile",
                "memory",
                "--contexts",
                "8,16",
                "--mode",
                "fwd,train",
                "--precision",
                "fp32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "results" / "profile_memory.jsonl").read_text().splitlines()]
    assert "allocated before the profiling started" not in capfd.readouterr().err  # the C++ profiler's line
    peaks = {(r["mode"], r["context"]): r["peak_gib"] for r in records}
    assert peaks[("fwd", 16)] > peaks[("fwd", 8)] > 0
    assert (tmp_path / "reports" / "memory_tiny.png").stat().st_size > 0
    page = (tmp_path / "reports" / "memory_tiny_train_fp32_ctx16.html").read_text()
    assert "<svg" in page and "http" not in page.split("<svg")[0]
    assert main(["analyze", "memory", "--preset", "small"]) == 0
    text = " ".join(capfd.readouterr().out.split())
    assert "128,625,408 parameters" in text and "1.92 GiB" in text  # 16 bytes x 128.6M params
    assert main(["profile", "memory", "--preset", "tiny,small"]) == 2
