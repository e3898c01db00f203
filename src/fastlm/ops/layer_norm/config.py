"""Launch settings of the norm kernels per GPU architecture, and the tiles and programs they give a
shape."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fastlm.ops.common import RowTiles, cdiv, device_arch, multiprocessors, row_tiles


@dataclass(frozen=True)
class NormConfig:
    """Launch settings of the norm kernels for one GPU architecture; the defaults are the H100's,
    from benchmarks/tune_norms.py (best geometric mean over the `fastlm bench norms` shapes, bf16
    and fp32; benchmarks/results/norms_tuning_h100.jsonl)."""

    # Elements per (BLOCK_M, BLOCK_D) forward tile and per warp: narrow rows are stacked into tiles
    # so that every program moves enough bytes.
    forward_tile: int = 2048
    forward_per_warp: int = 512
    # The same for the single-pass backward, whose programs each stride over many tiles.
    backward_tile: int = 4096
    backward_per_warp: int = 512
    # Single-pass backward programs per SM: each writes a (D,) partial row of dw / db.
    backward_programs_per_sm: int = 2
    # Widest rows held in registers (one read of each input); wider rows loop over chunks this wide.
    forward_block_max: int = 16384
    # The backward keeps more per element (x, dy, the dw / db accumulators), so its limit is lower.
    backward_block_max: int = 8192
    # RMSNorm of 16-bit rows keeps rows this wide in registers in the backward too: x, dy and its one
    # dw accumulator, 32 values each per thread at 16 warps, faster than looping at 4096 x 16384 bf16;
    # LayerNorm (a db accumulator and the mean more) and fp32 rows spill at that width.
    rms_16bit_backward_block_max: int = 16384
    # Rows per chunk of the looped backward (dx only, a power of two); its pass 2 re-reads each chunk
    # from L2.
    looped_backward_rows: int = 1
    # Looped-backward programs per SM: as many as keep this many bytes of x and dy chunks in flight,
    # so 2 in bf16 and 1 in fp32 (a second fp32 program was slower for RMSNorm, a single bf16 one too;
    # --sweep bwd,param 16384).
    looped_bytes_per_sm: int = 64 * 1024
    # dw / db of looped rows (_norm_param_grad_kernel): (block_m, block_d) tiles over row groups, so
    # cdiv(D, 512) x 16 programs and a (16, D) partial per gradient.
    param_grad_block_m: int = 8
    param_grad_block_d: int = 512
    param_grad_warps: int = 4
    param_grad_groups: int = 16
    # Widest single-pass rows whose dw / db are summed inside the backward's launch, saving a launch:
    # wider, the one program that adds up the group sums reads too much alone and the separate sum
    # kernel is faster (docs/notes/host_path.md; --sweep sum times both at every width).
    fused_sum_max_d: int = 1024
    # Those sums: partial rows per group (a power of two, about sqrt(programs) so that both levels
    # read about as much; also the rows per step of the wide rows' sums) and columns per step. Not
    # swept yet.
    fused_sum_group: int = 16
    fused_sum_block_d: int = 256
    # The separate sum (_sum_partials_kernel): (sum_block_p, sum_block_d) fp32 tiles, one program per
    # sum_block_d columns. Narrow column blocks give enough programs for 1024-wide rows (64 against
    # 8 with 128 columns; --sweep sum).
    sum_block_p: int = 256
    sum_block_d: int = 16


# Measured settings per architecture (device_arch); every other GPU, and the interpreter (0), takes
# the defaults.
_CONFIGS = {90: NormConfig()}
_INTERPRETER_PROGRAMS = 4  # backward programs on a CPU: enough for strided tiles and several partial rows


@functools.cache
def norm_config(arch: int) -> NormConfig:
    """The launch settings for GPUs of compute capability ``arch`` (`fastlm.ops.common.device_arch`).
    They depend on no dtype or shape: `forward_tiles` / `backward_tiles` apply them to a shape."""
    return _CONFIGS.get(arch, NormConfig())


def forward_tiles(config: NormConfig, d: int) -> RowTiles:
    return row_tiles(d, config.forward_tile, config.forward_per_warp, config.forward_block_max)


def backward_tiles(config: NormConfig, d: int, m: int, element_size: int, rms: bool, sms: int) -> tuple[RowTiles, int]:
    """(tiles, programs) of the backward on a GPU of ``sms`` SMs (0: the interpreter). Rows up to
    backward_block_max wide (rms_16bit_backward_block_max for 16-bit RMSNorm): stacked tiles, one
    pass. Wider: chunks of up to looped_backward_rows rows x (backward_block_max / that) columns,
    fewer rows per chunk when there are too few rows to give every program a chunk of that many."""
    block_max = config.rms_16bit_backward_block_max if rms and element_size == 2 else config.backward_block_max
    tiles = row_tiles(d, config.backward_tile, config.backward_per_warp, block_max)
    if tiles.single_pass:
        return tiles, min(cdiv(m, tiles.block_m), _programs_per_gpu(config, tiles, element_size, sms))
    rows = config.looped_backward_rows  # a power of two (tl.arange)
    while rows > 1:
        chunks = RowTiles(rows, config.backward_block_max // rows, False, tiles.num_warps)
        capacity = _programs_per_gpu(config, chunks, element_size, sms)
        if rows <= m and cdiv(m, rows) >= min(m, capacity):
            return chunks, min(cdiv(m, rows), capacity)
        rows //= 2
    chunks = RowTiles(1, config.backward_block_max, False, tiles.num_warps)
    return chunks, min(m, _programs_per_gpu(config, chunks, element_size, sms))


def _programs_per_gpu(config: NormConfig, tiles: RowTiles, element_size: int, sms: int) -> int:
    """A few backward programs per SM, each striding over the row tiles: few (programs, D) partials
    (single pass), or looped_bytes_per_sm of x and dy chunks in flight (looped)."""
    if sms == 0:
        return _INTERPRETER_PROGRAMS
    if not tiles.single_pass:
        per_sm = max(1, config.looped_bytes_per_sm // (2 * tiles.block_m * tiles.block_d * element_size))
    elif tiles.block_d > config.backward_block_max:
        per_sm = 1  # a 16384-wide program's registers fill an SM: a second one only waits
    else:
        per_sm = config.backward_programs_per_sm
    return per_sm * sms


def _multiprocessors(device: torch.device) -> int:
    return multiprocessors(device.index) if device.type == "cuda" else 0


# The choices for the picked config, once per (device, shape): per call a dict lookup. Keyed by device
# (its architecture and SM count); bounded, as a run with varying row counts adds one per count.
@functools.lru_cache(maxsize=1024)
def _picked_forward_tiles(device: torch.device, d: int) -> RowTiles:
    return forward_tiles(norm_config(device_arch(device)), d)


@functools.lru_cache(maxsize=1024)
def _picked_backward(device: torch.device, d: int, m: int, element_size: int, rms: bool):
    """(config, tiles, programs) of the backward."""
    config = norm_config(device_arch(device))
    return config, *backward_tiles(config, d, m, element_size, rms, _multiprocessors(device))
