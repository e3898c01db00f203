"""Launch configuration of the cross-entropy kernels: blocks and warps per GPU architecture, applied
to the vocabulary width."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from fastlm.ops.common import device_arch, next_power_of_2


@dataclass(frozen=True)
class XentConfig:
    """Blocks and warps of the cross-entropy kernels. Frozen, so it can key caches; make a variant
    with `dataclasses.replace(config, fused_warps=4)`. Blocks are used as given (powers of two)."""

    forward_block: int  # BLOCK_V of the forward: columns per step of the one program per row
    forward_warps: int  # warps per forward program
    backward_block: int  # BLOCK_V of the backward and the scale-rows kernels: columns per program
    backward_warps: int  # warps per backward / scale-rows program
    fused_block: int  # BLOCK_V of the fused kernel: columns per step of both passes over a row
    fused_warps: int  # warps per fused program
    fused_programs_per_sm: int  # persistent fused grid: few enough rows in flight for L2 to hold them
    fused_count_block: int  # targets per step when each fused program counts a mean's valid rows


# From benchmarks/tune_xent.py (B=4096, bf16, V in 32000, 50264, 128256): the forward and
# backward on an H200 (benchmarks/results/xent_tuning_h200.jsonl), the fused kernel on an H100
# (xent_tuning_h100.jsonl), where 32 programs per SM, one per row at B=4096, beat the persistent
# grid of 2 per SM by 3-16%.
DEFAULT_CONFIG = XentConfig(
    forward_block=8192,
    forward_warps=4,
    backward_block=4096,
    backward_warps=4,
    fused_block=16384,
    fused_warps=8,
    fused_programs_per_sm=32,
    fused_count_block=4096,  # int64: 32 KB per step, one step up to B = 4096 (not tuned)
)
_CONFIGS = {90: DEFAULT_CONFIG}  # by device_arch; other GPUs and the interpreter take the same values


@functools.cache
def cross_entropy_config(arch: int, dtype: torch.dtype, vocab: int) -> XentConfig:
    """The launch configuration for ``vocab``-wide rows of ``dtype`` logits on GPU architecture
    ``arch`` (`device_arch`: 90 for H100 / H200, 0 for the interpreter): the table's entry (measured
    in bf16; no entry depends on the dtype yet), its blocks no wider than the row needs. Cached, so
    a call costs one dict lookup."""
    config = _CONFIGS.get(arch, DEFAULT_CONFIG)
    return replace(
        config,
        forward_block=_row_block(vocab, config.forward_block),
        backward_block=_row_block(vocab, config.backward_block),
        fused_block=_fused_row_block(vocab, config.fused_block),
    )


def _fused_row_block(vocab, widest: int):
    """`_row_block`, halved while its blocks would pad the row by more than a sixth: at V=50264 a
    16384 block pads it by 30% and measured 8% slower than 8192 (14%); 32000 and 128256 pad by
    2% at 16384. A symbolic vocab (a trace with dynamic shapes) keeps `_row_block`'s, guarding on
    nothing more."""
    block = _row_block(vocab, widest)
    while type(vocab) is int and block > 1024 and 6 * (-vocab % block) > vocab:
        block //= 2
    return block


def _row_block(vocab, widest: int):
    """``widest``, or the row rounded up to a power of two when that is narrower. Written so that
    a symbolic vocab of a trace guards on ``vocab > widest / 2`` only, which LM vocabularies pass."""
    return widest if vocab > widest // 2 else next_power_of_2(vocab)


def _picked_config(logits: torch.Tensor, vocab=None) -> XentConfig:
    """The config for ``logits`` (B, V') of which the first ``vocab`` columns (None: all) are the
    vocabulary."""
    vocab = logits.shape[1] if vocab is None else vocab
    # Inside a triton_op traced with dynamic shapes the vocab is a SymInt, which cannot key the
    # cache; a trace picks once, so it calls the function uncached.
    pick = cross_entropy_config if type(vocab) is int else cross_entropy_config.__wrapped__
    return pick(device_arch(logits.device), logits.dtype, vocab)
