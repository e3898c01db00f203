"""Warmup + cosine learning-rate schedule: the values at its landmarks and its shape."""

import math

import pytest

from fastlm.optim.schedule import warmup_cosine_lr

SCHEDULE = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 10, "steps": 110}


def test_landmarks():
    lr = [warmup_cosine_lr(step, **SCHEDULE) for step in range(111)]
    assert lr[0] == pytest.approx(1e-3 / 11) and lr[9] == pytest.approx(1e-3 * 10 / 11)  # linear warmup
    assert lr[10] == pytest.approx(1e-3)  # the peak, where the cosine starts
    assert lr[60] == pytest.approx(0.5 * (1e-3 + 1e-4))  # halfway down the cosine: the mean of both ends
    assert lr[110] == pytest.approx(1e-4) and lr[109] > 1e-4  # the floor is reached after the last step
    assert all(a < b for a, b in zip(lr[:10], lr[1:11], strict=True))
    assert all(a > b for a, b in zip(lr[10:110], lr[11:111], strict=True))
    assert lr[85] == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.75)) * 9e-4)


def test_no_warmup_and_constant():
    assert warmup_cosine_lr(0, lr=1e-3, min_lr=0.0, warmup=0, steps=5) == pytest.approx(1e-3)
    assert {warmup_cosine_lr(step, lr=1e-3, min_lr=1e-3, warmup=0, steps=5) for step in range(5)} == {1e-3}
    assert warmup_cosine_lr(50, lr=1e-3, min_lr=1e-4, warmup=100, steps=20) < 1e-3  # warmup longer than the run
