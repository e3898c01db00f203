"""The fastlm Transformer LM and its configuration."""

from fastlm.model.config import PRESETS, ModelConfig
from fastlm.model.transformer import TransformerLM

__all__ = ["PRESETS", "ModelConfig", "TransformerLM"]
