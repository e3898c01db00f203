"""The benchmarks' commands run here as a user's CPU runs them: fastlm's ops on their PyTorch
paths, not under the Triton interpreter (tests/conftest.py turns it on for the kernel tests, which
test the kernels; a benchmark's dozens of timed calls would take minutes in the interpreter)."""

import pytest


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
