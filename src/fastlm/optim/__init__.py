"""Optimizers whose step runs as fused Triton kernels."""

from fastlm.optim.adamw import AdamW, AdamWConfig, adamw_config

__all__ = ["AdamW", "AdamWConfig", "adamw_config"]
