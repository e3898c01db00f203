"""The scaled cast: bitwise the cast then the multiply, for each widening the gradients take (and
the identity), partial blocks, errors."""

import pytest
import torch

from fastlm.ops.scaled_cast import BLOCK, scaled_cast, scaled_cast_ref


@pytest.mark.parametrize(
    ("narrow", "wide"),
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("n", [1, 1000, BLOCK + 3])  # one partial block; a full one and a partial one
def test_equals_the_cast_then_the_multiply(device, narrow, wide, n):
    x = (torch.randn(n, device=device) * 100).to(narrow)
    scale = torch.tensor(0.37, device=device)  # no power of two: the products round
    expected = x.to(wide, copy=True)
    assert torch.equal(scaled_cast(x, wide), expected)
    expected.mul_(scale)  # what clipping after the cast does
    assert torch.equal(scaled_cast(x, wide, scale), expected)
    assert torch.equal(scaled_cast_ref(x.cpu(), wide, scale.cpu()), expected.cpu())


def test_empty(device):
    assert scaled_cast(torch.empty(0, device=device, dtype=torch.bfloat16), torch.float32).shape == (0,)


@pytest.mark.parametrize(
    ("x", "dtype", "scale", "message"),
    [
        (torch.ones(2, 3), torch.float32, None, "1-D and contiguous"),
        (torch.ones(6)[::2], torch.float32, None, "1-D and contiguous"),
        (torch.ones(4), torch.bfloat16, None, "at least as wide"),
        (torch.ones(4, dtype=torch.int32), torch.float32, None, "at least as wide"),
        (torch.ones(4), torch.float32, torch.ones(2), "one element"),
        (torch.ones(4), torch.float32, torch.ones(1, device="meta"), "one element on cpu"),
    ],
)
def test_bad_inputs(x, dtype, scale, message):
    with pytest.raises(ValueError, match=message):
        scaled_cast(x, dtype, scale)
