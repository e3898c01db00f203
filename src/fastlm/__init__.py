"""fastlm: fused Triton kernels, a switchable Transformer LM, benchmarks and napkin math.

The public functional API lives here; ``fastlm.layers`` has the modules built on it. Each function's op
module (and with it torch and Triton) is imported on first use, so `import fastlm` and the command
line's help and cost models start fast.
"""

import importlib

_EXPORTS = {
    "apply_fastlm": "fastlm.integrations.huggingface",
    "bradley_terry_loss": "fastlm.losses",
    "causal_conv1d": "fastlm.ops.causal_conv1d",
    "cross_entropy": "fastlm.ops.cross_entropy",
    "dpo_loss": "fastlm.losses",
    "flash_attention": "fastlm.ops.flash_attention",
    "flash_attention_varlen": "fastlm.ops.flash_attention",
    "fp8_linear": "fastlm.ops.fp8_linear",
    "geglu": "fastlm.ops.swiglu",
    "layer_norm": "fastlm.ops.layer_norm",
    "linear_cross_entropy": "fastlm.ops.linear_cross_entropy",
    "linear_dpo_loss": "fastlm.losses",
    "masked_softmax": "fastlm.ops.masked_softmax",
    "ranking_loss": "fastlm.losses",
    "revert_fastlm": "fastlm.integrations.huggingface",
    "rms_norm": "fastlm.ops.layer_norm",
    "rotary_embedding": "fastlm.ops.rotary",
    "sequence_logprobs": "fastlm.losses",
    "swiglu": "fastlm.ops.swiglu",
}
# Subpackages the docs reach as attributes after `import fastlm` (fastlm.layers.RMSNorm, fastlm.optim.AdamW)
_SUBPACKAGES = ("layers", "optim", "model")
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"fastlm.{name}")  # which sets it as this module's attribute
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})
