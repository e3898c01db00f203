"""Test setup: Triton interpreter on CPU-only machines, seeded RNGs, the `gpu` marker.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before fastlm is
imported, which is why it is set at the top of this module.
"""

import os
import random

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_bf16_dot():
    """Triton 3.6's interpreter keeps bf16 tensors as uint16 bit patterns and tl.dot multiplies
    those integers. Widen bf16 operands to fp32 first (exact), as the GPU's tensor cores do."""
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.data.dtype != np.uint16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), interpreter.tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    """The device the kernels are tested on: CUDA when present, else CPU through the interpreter."""
    return torch.device("cuda" if _HAS_CUDA else "cpu")
