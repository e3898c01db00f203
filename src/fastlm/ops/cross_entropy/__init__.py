"""Fused cross-entropy over large vocabularies, with ignore_index, label smoothing and a z-loss; the
fused path writes the gradient in the forward pass.

    kernels.py    the math, the cost model and the Triton kernels (forward, backward, fused, scale rows)
    config.py     blocks and warps per GPU architecture, applied to the vocabulary width
    launchers.py  allocate the outputs and launch the kernels, or take the reference path
    reference.py  `cross_entropy_ref` and the launchers' plain-PyTorch equivalents
    api.py        the torch.library ops, the autograd.Functions, `cross_entropy` and its checks
"""

from fastlm.ops.cross_entropy.api import (
    REDUCTIONS,
    TARGET_DTYPES,
    CrossEntropyFunction,
    CrossEntropyFusedFunction,
    check_inputs,
    check_options,
    check_target_dtype,
    check_target_range,
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_forward,
)
from fastlm.ops.cross_entropy.config import DEFAULT_CONFIG, XentConfig, cross_entropy_config

# the kernels and launchers, which benchmarks/tune_xent.py and the GPU tests launch directly
from fastlm.ops.cross_entropy.kernels import _cross_entropy_backward_kernel as _cross_entropy_backward_kernel
from fastlm.ops.cross_entropy.kernels import _cross_entropy_forward_kernel as _cross_entropy_forward_kernel
from fastlm.ops.cross_entropy.kernels import _cross_entropy_fused_kernel as _cross_entropy_fused_kernel
from fastlm.ops.cross_entropy.kernels import _scale_rows_kernel as _scale_rows_kernel
from fastlm.ops.cross_entropy.launchers import _backward as _backward
from fastlm.ops.cross_entropy.launchers import _forward as _forward
from fastlm.ops.cross_entropy.launchers import _fused as _fused
from fastlm.ops.cross_entropy.launchers import _scale_rows as _scale_rows
from fastlm.ops.cross_entropy.reference import cross_entropy_ref

__all__ = [
    "DEFAULT_CONFIG",
    "REDUCTIONS",
    "TARGET_DTYPES",
    "CrossEntropyFunction",
    "CrossEntropyFusedFunction",
    "XentConfig",
    "check_inputs",
    "check_options",
    "check_target_dtype",
    "check_target_range",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_config",
    "cross_entropy_forward",
    "cross_entropy_ref",
]
