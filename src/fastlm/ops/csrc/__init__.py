"""CUDA C++ sources of fastlm's kernels, compiled on first use with torch.utils.cpp_extension
(needs nvcc; the build is cached under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def load_causal_conv1d():
    """The compiled `causal_conv1d` extension module (its `forward(u, weight, bias, silu)`)."""
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name("causal_conv1d.cu")
    return load(name="fastlm_causal_conv1d", sources=[str(source)], extra_cuda_cflags=["-O3"], verbose=False)
