"""Launch tiles of the attention kernels: per GPU architecture, dtype, head dim and sequence length."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from fastlm.ops.common import next_power_of_2

MAX_HEAD_DIM = 256  # the widest head the tables below cover


@dataclass(frozen=True)
class AttentionTiles:
    """How one kernel covers the (queries x keys) plane."""

    block_m: int  # query rows per tile: a program's tile (forward, dQ) or the dK/dV loop's step
    block_n: int  # key rows per tile: the forward / dQ loop's step, or the dK/dV program's tile
    num_warps: int  # warps per program
    num_stages: int  # software-pipelining depth of the tile loop (shared-memory buffers)


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the three kernels for one (GPU architecture, dtype, head dim)."""

    forward: AttentionTiles  # _flash_forward_kernel
    dkdv: AttentionTiles  # _flash_backward_dkdv_kernel
    dq: AttentionTiles  # _flash_backward_dq_kernel (which also forms Dlt)
    # the forward's tiles through TMA descriptors where the inputs allow (aligned rows, a head dim
    # that is a power of two: launchers._descriptors_fit), else through pointers
    forward_descriptors: bool = False


def _entry(forward: tuple, dkdv: tuple, dq: tuple, forward_descriptors: bool = False) -> AttentionConfig:
    """A table entry from each kernel's (block_m, block_n, num_warps, num_stages)."""
    return AttentionConfig(AttentionTiles(*forward), AttentionTiles(*dkdv), AttentionTiles(*dq), forward_descriptors)


# sm90 (H100 / H200), by (padded head dim, bytes per element), each kernel's tiles as (BLOCK_M,
# BLOCK_N, warps, stages). bf16/fp16 at head dims 64 and 128 and the fp32 forward are the fastest
# measured by benchmarks/tune_attention.py on an H200 (B=8, H=16, N=4096, causal;
# benchmarks/results/attention_tuning_h200.jsonl); dQ shares the dK/dV tiles except where that sweep
# found better ones (bf16/fp16, head dim <= 128). The other entries are scaled from them to fit
# registers and shared memory, and are checked by the GPU tests, not tuned. The forward loads its
# tiles through TMA descriptors at head dim 128 (16-bit), where they ran faster than pointers at
# the same tiles (benchmarks/probe_attention_tma.py; at 64 they ran slower).
SM90_TILES = {
    (16, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (32, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (64, 2): _entry((64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 3)),
    (128, 2): _entry((128, 128, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3), forward_descriptors=True),
    (256, 2): _entry((64, 32, 4, 2), (32, 32, 4, 1), (32, 32, 4, 1)),
    (16, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (32, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (64, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (128, 4): _entry((32, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 2)),
    (256, 4): _entry((32, 32, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)),
}
# Sequences of at most SHORT_SEQ keys. There the grid is short (at 4 x 12 heads x 512 tokens the
# long-sequence dQ tiles make 192 programs for 132 SMs) and each program's loop a few steps, so
# smaller backward tiles win: the fastest measured by benchmarks/tune_attention.py on an H100 at
# the presets' shapes, 4 x 12 and 16 x 25 heads x 512 tokens, head dim 64 (both shapes picked the
# same dK/dV and dQ tiles; benchmarks/results/attention_tuning_h100.jsonl). At 8 x 12 heads x 2048
# tokens (the training shape of the small preset) the same sweep picked these dK/dV tiles too (the
# backward 6% faster than with the long-sequence ones) and dQ tiles within 2% of these; wider grids
# at 2048 keys (more batch entries or heads) were not measured. At head dim 128 the forward's and
# dK/dV's tiles are the fastest of `tune_attention.py --packed` on an H100 over documents of median
# length 512 (attention_tuning_packed_h100.jsonl), the dQ tiles the long-sequence ones, which it
# kept; against the long-sequence entry at 32 x 16 x 1024 and 8 x 16 x 2048 they took 4-12% less
# time (benchmarks/ab_attention.py tiles, attention_tiles_ab.jsonl). Entries it lacks fall back to
# SM90_TILES.
SHORT_SEQ = 2048
SM90_SHORT_TILES = {
    (64, 2): _entry((64, 64, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3)),
    (128, 2): _entry((64, 64, 4, 3), (32, 64, 4, 3), (128, 64, 8, 3), forward_descriptors=True),
}
# Tables by compute capability, (long, short). Other GPUs, and 0 (the interpreter, where tiles only
# set which masking paths the tests exercise), take the sm90 tiles: no other architecture was measured.
# GPUs before sm90 have no TMA: their forward loads through pointers.
TILES_BY_ARCH = {90: (SM90_TILES, SM90_SHORT_TILES)}
FIRST_TMA_ARCH = 90


@functools.cache
def padded_head_dim(head_dim: int) -> int:
    """Head dim padded to a power of two of at least 16, the smallest `tl.dot` operand."""
    return max(16, next_power_of_2(head_dim))


def attention_config(arch: int, dtype: torch.dtype, head_dim: int, keys: int | None = None) -> AttentionConfig:
    """The tiles for a GPU of compute capability ``arch`` (``device_arch``), inputs of ``dtype``, a
    head dim in [1, MAX_HEAD_DIM] and ``keys`` keys per head (packed sequences: the longest
    document's; None: long sequences). One comparison
    and a cached lookup per call; with a symbolic ``keys`` (a trace with dynamic shapes) the
    comparison becomes a guard on ``keys <= SHORT_SEQ``."""
    return _table_config(arch, dtype, padded_head_dim(head_dim), keys is not None and keys <= SHORT_SEQ)


@functools.cache
def _table_config(arch: int, dtype: torch.dtype, block_d: int, short: bool) -> AttentionConfig:
    long_tiles, short_tiles = TILES_BY_ARCH.get(arch, TILES_BY_ARCH[90])
    key = (block_d, min(dtype.itemsize, 4))
    config = short_tiles.get(key, long_tiles[key]) if short else long_tiles[key]
    if 0 < arch < FIRST_TMA_ARCH and config.forward_descriptors:
        return replace(config, forward_descriptors=False)
    return config
