"""FlashAttention-2 in Triton: dense and packed (variable-length) sequences, causal and sliding-window
masks, grouped-query heads, deterministic gradients.

    kernels.py    the Triton kernels (forward; backward as dQ, then dK/dV), their math and cost model
    config.py     launch tiles per GPU architecture, dtype, head dim and sequence length
    launchers.py  allocate the outputs and launch the kernels
    masks.py      the causal flag and the window as bounds on key positions; the window's check
    tiled.py      the same algorithm tiled in plain PyTorch: the readable twin, and the path of
                  traced CPU inputs
    sdpa.py       the eager CPU path: torch's SDPA, packed documents batched by length
    api.py        the torch.library ops, the autograd.Functions, `flash_attention` and its reference
    varlen.py     `flash_attention_varlen` (packed documents) and its reference
"""

from fastlm.ops.flash_attention.api import (
    DTYPES,
    FlashAttentionTorch,
    FlashAttentionTriton,
    check_inputs,
    default_scale,
    flash_attention,
    flash_attention_ref,
)
from fastlm.ops.flash_attention.config import (
    MAX_HEAD_DIM,
    SHORT_SEQ,
    SM90_SHORT_TILES,
    SM90_TILES,
    TILES_BY_ARCH,
    AttentionConfig,
    AttentionTiles,
    attention_config,
)

# the launchers, which benchmarks/tune_attention.py times with each candidate config
from fastlm.ops.flash_attention.launchers import _launch_backward as _launch_backward
from fastlm.ops.flash_attention.launchers import _launch_forward as _launch_forward
from fastlm.ops.flash_attention.masks import check_window
from fastlm.ops.flash_attention.tiled import TORCH_TILE
from fastlm.ops.flash_attention.varlen import (
    check_cu_seqlens,
    check_varlen_inputs,
    flash_attention_varlen,
    flash_attention_varlen_ref,
)

__all__ = [
    "DTYPES",
    "MAX_HEAD_DIM",
    "SHORT_SEQ",
    "SM90_SHORT_TILES",
    "SM90_TILES",
    "TILES_BY_ARCH",
    "TORCH_TILE",
    "AttentionConfig",
    "AttentionTiles",
    "FlashAttentionTorch",
    "FlashAttentionTriton",
    "attention_config",
    "check_cu_seqlens",
    "check_inputs",
    "check_varlen_inputs",
    "check_window",
    "default_scale",
    "flash_attention",
    "flash_attention_ref",
    "flash_attention_varlen",
    "flash_attention_varlen_ref",
]
