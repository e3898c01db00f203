"""The fastlm Transformer LM and its configuration. The configuration needs no torch; the model
(and with it torch and the kernels) is imported on first use of `TransformerLM`."""

from fastlm.model.config import PRESETS, ModelConfig

__all__ = ["PRESETS", "ModelConfig", "TransformerLM"]


def __getattr__(name: str):
    if name != "TransformerLM":
        raise AttributeError(f"module 'fastlm.model' has no attribute {name!r}")
    from fastlm.model.transformer import TransformerLM

    return TransformerLM
