"""The nn.Module building blocks of fastlm's model and of its Hugging Face patch, each switching
between a fused kernel and PyTorch's ops by the one rule of `fastlm.layers.rules`:

    RMSNorm, LayerNorm        norms.py       fastlm.rms_norm / fastlm.layer_norm
    RotaryEmbedding           rotary.py      fastlm.rotary_embedding
    Attention                 attention.py   fastlm.flash_attention (packed, windows), SDPA, naive
    SwiGLUMLP                 mlp.py         fastlm.swiglu (gated_activation: fastlm.geglu too)
    MoEMLP, experts_output    moe.py         fastlm.ops.moe.moe_experts: a mixture of experts, its experts
    LMHeadLoss                loss.py        fastlm.linear_cross_entropy
    CrossEntropyLoss, LinearCrossEntropyLoss  module forms of the losses
    Linear, Embedding         linear.py      the model's bias-free layers and their initializations
"""

from fastlm.layers.attention import Attention
from fastlm.layers.linear import Embedding, Linear
from fastlm.layers.loss import CrossEntropyLoss, LinearCrossEntropyLoss, LMHeadLoss
from fastlm.layers.mlp import SwiGLUMLP
from fastlm.layers.moe import MoEMLP, experts_output
from fastlm.layers.norms import LayerNorm, RMSNorm
from fastlm.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "CrossEntropyLoss",
    "Embedding",
    "LMHeadLoss",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropyLoss",
    "MoEMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "experts_output",
]
