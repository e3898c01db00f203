"""LayerNorm and RMSNorm over the last dimension: fused Triton forward and backward, statistics in
fp32, dw / db summed in a fixed order.

    kernels.py    the math, the algorithm and the Triton kernels (forward; backward with dw / db sums)
    config.py     launch settings per GPU architecture; the tiles and programs they give a shape
    launchers.py  allocate the outputs and launch the kernels, or take the reference path
    reference.py  `layer_norm_ref`, `rms_norm_ref` and the launchers' plain-PyTorch path
    api.py        the torch.library ops, the autograd.Function, `layer_norm`, `rms_norm`, their checks
"""

from fastlm.ops.layer_norm.api import NormFunction, check_inputs, layer_norm, rms_norm

# the ops and the autograd entry point with a launch config, which the tests call directly
from fastlm.ops.layer_norm.api import _apply as _apply
from fastlm.ops.layer_norm.api import _backward_op as _backward_op
from fastlm.ops.layer_norm.api import _forward_op as _forward_op
from fastlm.ops.layer_norm.config import NormConfig, backward_tiles, forward_tiles, norm_config
from fastlm.ops.layer_norm.config import _picked_backward as _picked_backward

# the kernels, launchers and counters, which benchmarks/tune_norms.py and the tests use directly
from fastlm.ops.layer_norm.kernels import _norm_backward_kernel as _norm_backward_kernel
from fastlm.ops.layer_norm.kernels import _norm_forward_kernel as _norm_forward_kernel
from fastlm.ops.layer_norm.launchers import _COUNTERS as _COUNTERS
from fastlm.ops.layer_norm.launchers import _backward as _backward
from fastlm.ops.layer_norm.launchers import _forward as _forward
from fastlm.ops.layer_norm.reference import layer_norm_ref, rms_norm_ref

__all__ = [
    "NormConfig",
    "NormFunction",
    "backward_tiles",
    "check_inputs",
    "forward_tiles",
    "layer_norm",
    "layer_norm_ref",
    "norm_config",
    "rms_norm",
    "rms_norm_ref",
]
