"""`fastlm bench roofline` on CPU: points from the benchmarks' records, roofs from the ceilings."""

import pytest

from fastlm.bench.roofline import Point
from fastlm.cli import main


def test_point_by_hand():
    point = Point("conv", "case", flops=6e9, bytes=4e9, seconds=2e-3)
    assert point.intensity == 1.5 and point.tflops == pytest.approx(3.0)


def test_command_places_every_benchmarked_kernel(tmp_path):
    for op in ("norms", "softmax", "conv1d"):
        assert main(["bench", op, "--out", str(tmp_path)]) == 0
    assert main(["bench", "roofline", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "reports" / "roofline.md").read_text()
    for kernel in ("layer norm", "rms norm", "masked softmax", "causal conv1d"):
        assert f"| {kernel} |" in report
    assert (tmp_path / "reports" / "roofline.png").stat().st_size > 0
