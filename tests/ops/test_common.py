"""The host-side helpers every launcher shares."""

import torch
import triton

from fastlm.ops.common import cdiv, may_overlap, next_power_of_2


def test_grid_arithmetic_matches_triton():
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024, 1025, 65535, 65536, 2**31 - 1, 2**31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_may_overlap_flags_views_whose_elements_share_memory():
    base = torch.randn(6, 10)
    assert not may_overlap(base)
    assert not may_overlap(base.t())  # transposed: strides (1, 10)
    assert not may_overlap(base[:, 2:7])  # padded rows: row stride 10 > 5 columns
    assert not may_overlap(base[::2, ::3])  # strided both ways
    assert not may_overlap(torch.randn(1, 10).expand(1, 10))  # a stride-0 dim of size 1 maps nothing twice
    assert may_overlap(torch.randn(1, 10).expand(4, 10))  # every row the same memory
    assert may_overlap(torch.randn(20).as_strided((3, 4), (1, 1)))  # x[i, j] = x[i + j]
    assert may_overlap(torch.randn(20).as_strided((3, 4), (3, 1)))  # rows 4 long, 3 apart: overlap by one
