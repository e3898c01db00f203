"""Cross-entropy cost model pinned to values computed by hand for B=4096, V=128256.

B*V = 525,336,576 elements.
"""

import pytest

from fastlm.analysis.xent import CrossEntropyCost
from fastlm.devices import device_spec

COST = CrossEntropyCost(batch=4096, vocab=128256)


def test_bytes():
    assert COST.fwd_bytes_loaded == 1_050_705_920  # 2 * 525,336,576 + 8 * 4096
    assert COST.fwd_bytes_stored == 32_768  # (4 + 4) * 4096
    assert COST.bwd_bytes_loaded == 1_050_738_688  # 2 * 525,336,576 + 16 * 4096
    assert COST.bwd_bytes_stored == 1_050_673_152  # 2 * 525,336,576
    assert COST.fused_bytes == 2_101_395_456  # 4 * 525,336,576 + 12 * 4096


def test_flops():
    assert COST.fwd_flops_per_token == 384_771
    assert COST.bwd_flops_per_token == 384_769
    assert COST.fwd_flops == 1_576_022_016
    assert COST.bwd_flops == 1_576_013_824


def test_h100_bound():
    h100 = device_spec("h100")
    fwd, bwd = COST.fwd_bound(h100), COST.bwd_bound(h100)
    assert fwd.intensity == pytest.approx(1_576_022_016 / 1_050_738_688)  # 1.49991 FLOP/B
    assert bwd.intensity == pytest.approx(1_576_013_824 / 2_101_411_840)  # 0.74998 FLOP/B
    assert fwd.ridge == pytest.approx(67e12 / 3350e9)  # 20 FLOP/B on the CUDA cores
    assert h100.ridge_flops_per_byte == pytest.approx(989e12 / 3350e9)  # 295 on the tensor cores
    assert fwd.verdict == bwd.verdict == "memory-bound"
    assert fwd.min_time_s * 1e6 == pytest.approx(313.653, abs=1e-3)  # 1,050,738,688 B / 3.35 TB/s
    assert bwd.min_time_s * 1e6 == pytest.approx(627.287, abs=1e-3)  # 2,101,411,840 B / 3.35 TB/s


def test_scales_linearly_in_batch_and_vocab():
    double = CrossEntropyCost(batch=8192, vocab=128256)
    assert double.fwd_bytes == 2 * COST.fwd_bytes
    assert CrossEntropyCost(4096, 2 * 128256).bwd_bytes_stored == 2 * COST.bwd_bytes_stored


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown GPU 'v100'; known: a100, h100, h200, t4"):
        device_spec("v100")
