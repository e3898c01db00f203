import pytest

from fastlm.profile.timeline import covered, gpu_timeline


def test_covered_counts_overlaps_once():
    assert covered([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert covered([]) == 0


def test_timeline_splits_a_step_into_compute_communication_and_idle():
    # 2 steps over 0-100 us: compute 0-40 and 50-80, an all-reduce 30-60 (hidden 30-40 and 50-60,
    # exposed 40-50), nothing 80-90, a last kernel 90-100
    kernels = [
        ("gemm_a", 0, 40),
        ("ncclDevKernel_AllReduce_Sum_f32", 30, 60),
        ("gemm_b", 50, 80),
        ("triton_poi_fused_add", 90, 100),
    ]
    timeline = gpu_timeline(kernels, steps=2)
    assert timeline.span_ms == pytest.approx(0.05)  # 100 us over 2 steps
    assert timeline.compute_ms == pytest.approx(0.04)  # 80 us
    assert timeline.communication_ms == pytest.approx(0.015)  # 30 us
    assert timeline.exposed_communication_ms == pytest.approx(0.005)  # 10 us
    assert timeline.idle_ms == pytest.approx(0.005)  # 10 us


def test_a_profile_without_kernels_is_an_error():
    with pytest.raises(ValueError, match="no GPU kernels"):
        gpu_timeline([], steps=1)
