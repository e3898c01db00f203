"""fastlm: fused Triton kernels, a switchable Transformer LM, benchmarks and napkin math.

The public functional API lives here; ``fastlm.nn`` has thin module wrappers.
"""

from fastlm.ops.cross_entropy import cross_entropy

__all__ = ["cross_entropy"]
__version__ = "0.1.0"
