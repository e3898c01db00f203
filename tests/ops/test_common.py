"""The host-side helpers every launcher shares."""

import triton

from fastlm.ops.common import cdiv, next_power_of_2


def test_grid_arithmetic_matches_triton():
    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024, 1025, 65535, 65536, 2**31 - 1, 2**31 + 5]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
