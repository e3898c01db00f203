"""fastlm: fused Triton kernels, a switchable Transformer LM, benchmarks and napkin math.

The public functional API lives here; ``fastlm.nn`` has thin module wrappers.
"""

from fastlm.ops.causal_conv1d import causal_conv1d
from fastlm.ops.cross_entropy import cross_entropy
from fastlm.ops.flash_attention import flash_attention
from fastlm.ops.layer_norm import layer_norm, rms_norm
from fastlm.ops.linear_cross_entropy import linear_cross_entropy
from fastlm.ops.masked_softmax import masked_softmax

__all__ = [
    "causal_conv1d",
    "cross_entropy",
    "flash_attention",
    "layer_norm",
    "linear_cross_entropy",
    "masked_softmax",
    "rms_norm",
]
__version__ = "0.1.0"
