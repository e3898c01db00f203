"""`fastlm bench roofline` on CPU: points from the benchmarks' records, roofs from the ceilings."""

import pytest

from fastlm.bench.roofline import CPU_NOTE, Point, render_roofline
from fastlm.cli import main


def test_point_by_hand():
    point = Point("conv", "case", flops=6e9, bytes=4e9, seconds=2e-3)
    assert point.intensity == 1.5 and point.tflops == pytest.approx(3.0)


@pytest.mark.slow
def test_command_places_every_benchmarked_kernel(tmp_path):
    for op in ("norms", "softmax", "conv1d"):
        assert main(["bench", op, "--out", str(tmp_path)]) == 0
    assert main(["bench", "roofline", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "reports" / "roofline.md").read_text()
    for kernel in ("layer norm", "rms norm", "masked softmax", "causal conv1d"):
        assert f"| {kernel} |" in report
    assert (tmp_path / "reports" / "roofline.png").stat().st_size > 0


def test_header_gives_the_measured_matmul_dtype_and_rate(tmp_path):
    ceilings = {
        "gpu": "cpu",
        "date": "today",
        "git_sha": "abc",
        "copy_gbps": 9.87,
        "matmul_tflops": 0.25,
        "matmul_dtype": "float32",
    }
    text = render_roofline(tmp_path / "results", tmp_path / "reports", ceilings)
    assert "copy 9.87 GB/s, float32 matmul 0.25 TFLOP/s" in text  # was 'bf16 matmul 0' on a CPU
    assert "GPU" not in text.replace(CPU_NOTE, "") and CPU_NOTE in text
