"""Launchers: allocate the outputs and launch the attention kernels, with as little Python per call as
a launch can have.

Dense inputs: q (Z, H, M, D) and k, v (Z, Hkv, N, D), or 3-D (Z, M, D), (Z, N, D) read as one head
(head stride 0). Packed (``cu_seqlens_q`` and ``cu_seqlens_k`` given): q (total_q, H, D) and k, v
(total_k, Hkv, D), Z documents delimited by int32 cumulative lengths (Z + 1,). Any strides. Each
kernel launches through its `fastlm.ops.launch.launcher`: directly in eager calls, from Inductor's
generated code inside the triton_ops (``traced``).

Dense launches pass None for the cumulative lengths, not a stand-in tensor: the kernels hand those
pointers to helper functions, and torch.compile's analysis of a launch counts every tensor handed to
a helper whose result reaches a store as written, so it would copy a stand-in before each launch.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

from fastlm.ops.common import cdiv, dot_precision, is_traced
from fastlm.ops.flash_attention.config import AttentionConfig, padded_head_dim
from fastlm.ops.flash_attention.kernels import (
    _flash_backward_dkdv_kernel,
    _flash_backward_dq_kernel,
    _flash_forward_kernel,
)
from fastlm.ops.flash_attention.layout import contiguous_gradients, empty_result, empty_token_major
from fastlm.ops.flash_attention.masks import UNBOUNDED, window_bounds
from fastlm.ops.launch import launcher

_launch_flash_forward = launcher(_flash_forward_kernel)
_launch_flash_backward_dq = launcher(_flash_backward_dq_kernel)
_launch_flash_backward_dkdv = launcher(_flash_backward_dkdv_kernel)


def _dims(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(Z, heads, rows, D) of a dense 4-D tensor; a 3-D one is a single head."""
    shape = t.shape
    return (shape[0], 1, shape[1], shape[2]) if len(shape) == 3 else shape


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' (batch, head, row, D) strides of a dense tensor (`_dims`)."""
    stride = t.stride()
    return (stride[0], 0, stride[1], stride[2]) if len(stride) == 3 else stride


def _packed_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' strides of a packed (total, heads, D) tensor: batch stride 0 (the kernels offset
    each document by its first row)."""
    stride = t.stride()
    return 0, stride[1], stride[0], stride[2]


def _problem(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None):
    """(Z, H, Hkv, M, N, D, strides): batch entries (packed: documents), query and key/value heads,
    query and key rows (packed: totals), head dim, and the function giving a tensor's kernel strides."""
    if cu_seqlens_q is None:
        Z, H, M, D = _dims(q)
        _, Hkv, N, _ = _dims(k)
        strides = _strides
    else:
        (M, H, D), (N, Hkv, _) = q.shape, k.shape
        Z = cu_seqlens_q.shape[0] - 1
        strides = _packed_strides
    # D: a constexpr of the kernels (and a config key): specialized in a trace with dynamic shapes
    return Z, H, Hkv, M, N, int(D), strides


def _grid(rows: int, block: int, heads: int, batch: int, packed: bool) -> tuple[int, int, int]:
    """Dense: (tiles, heads, batch entries). Packed: every document's tiles in one flat axis, with at
    most one spare slot per document (kernels._packed_tile)."""
    return (rows // block + batch, heads, 1) if packed else (cdiv(rows, block), heads, batch)


def _mask(causal: bool, window: tuple[int, int], queries: int, keys: int) -> tuple[int, int, bool, bool]:
    """The kernels' (window_left, window_right, BOUNDED_LEFT, BOUNDED_RIGHT). A side is bounded only
    where it can hide a key: a left bound >= keys - 1 hides none, nor a right bound >= queries - 1
    (packed: the totals, which bound every document's lengths), so a window wider than the
    sequence costs what no window costs, and the bounds passed stay below 2**31."""
    left, right = window_bounds(causal, window)
    bounded_left, bounded_right = 0 <= left < keys - 1, 0 <= right < queries - 1
    return left if bounded_left else 0, right if bounded_right else 0, bounded_left, bounded_right


def _descriptors_fit(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can cover these tensors' (rows, D) per head (packed: per document and
    head): unit stride along D, every other stride and the first element 16-byte aligned (a tensor
    of a trace, which has no address, by its storage offset: torch's allocators align storages, and
    Inductor copies inputs that are not)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or any(stride * size % 16 for stride in t.stride()[:-1]):
            return False
        if (t.storage_offset() * size % 16) if is_traced(t) else (t.data_ptr() % 16):
            return False
    return True


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch for the descriptors a kernel makes: 128 bytes per descriptor and
    program, from torch's caching allocator (so CUDA-graph capture takes it from the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _scratch_allocator(tma: bool, traced: bool):
    """Where a launch takes the descriptors' scratch from: None without descriptors. An eager launch
    sets `_scratch` in Triton's context variable for itself (a token to reset it after). A traced
    launch runs later: Inductor's generated code allocates the scratch itself, other backends
    (aot_eager) launch through Triton's own launcher, which takes Triton's allocator at that time;
    where none was ever set, this sets `_scratch` as it (`triton.set_allocator`), else it keeps the
    user's."""
    if not tma:
        return None
    if not traced:
        return _allocation._allocator.set(_scratch)
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
    return None


def _launch_forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    config: AttentionConfig,
    *,
    window=UNBOUNDED,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    softcap: float = 0.0,
    traced: bool = False,
):
    """-> O (q's shape and dtype, `empty_token_major`), L (fp32, contiguous: q.shape[:-1], packed
    (H, total_q)). ``softcap`` c > 0: the scores are c tanh(scale q k^T / c); 0: none."""
    Z, H, Hkv, M, N, D, strides = _problem(q, k, cu_seqlens_q)
    packed = cu_seqlens_q is not None
    o = empty_token_major(q)
    lse = q.new_empty((H, M) if packed else q.shape[:-1], dtype=torch.float32)
    if Z * H * M == 0:
        return o, lse
    if N == 0:  # no keys at all: every row is empty
        return o.zero_(), lse.fill_(float("-inf"))
    left, right, bounded_left, bounded_right = _mask(causal, window, M, N)
    tiles = config.forward
    block_d = padded_head_dim(D)
    # o is this function's own allocation (`empty_token_major`: strides multiples of D, an aligned
    # storage), so only the inputs need the check, per call
    tma = config.forward_descriptors and D == block_d and _descriptors_fit(q, k, v)
    scratch = _scratch_allocator(tma, traced)
    try:
        _launch_flash_forward(traced)[_grid(M, tiles.block_m, H, Z, packed)](
            q,
            k,
            v,
            o,
            lse,
            cu_seqlens_q,  # None when dense (see the module's docstring)
            cu_seqlens_k,
            *strides(q),
            *strides(k),
            *strides(v),
            *strides(o)[:3],
            *((0, M) if packed else (H * M, M)),
            H,
            H // Hkv,
            *((0, 0, Z) if packed else (M, N, 0)),
            scale,
            softcap,
            left,
            right,
            BOUNDED_LEFT=bounded_left,
            BOUNDED_RIGHT=bounded_right,
            VARLEN=packed,
            HEAD_DIM=D,
            BLOCK_D=block_d,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            PRECISION=dot_precision(q.dtype),
            TMA=tma,
            SOFTCAP=softcap > 0,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    finally:
        if scratch is not None:
            _allocation._allocator.reset(scratch)
    return o, lse


def _launch_backward(
    grad_out,
    q,
    k,
    v,
    o,
    lse,
    causal: bool,
    scale: float,
    config: AttentionConfig,
    *,
    window=UNBOUNDED,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    softcap: float = 0.0,
    traced: bool = False,
):
    """Gradients (dq, dk, dv) in the inputs' dtype, from the forward's O (`kernel_ready_output`) and
    L (contiguous, as the forward makes it), laid out by `contiguous_gradients`: dq by q, dk and dv by k
    and v together (one set of strides for both). Two launches: dQ (which stores Dlt), then dK/dV."""
    Z, H, Hkv, M, N, D, strides = _problem(q, k, cu_seqlens_q)
    packed = cu_seqlens_q is not None
    dq_contiguous, dkv_contiguous = contiguous_gradients(q, k, v)
    dq = empty_result(q, dq_contiguous)
    dk, dv = empty_result(k, dkv_contiguous), empty_result(k, dkv_contiguous, v.dtype)
    if Z * H * M == 0 or N == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    left, right, bounded_left, bounded_right = _mask(causal, window, M, N)
    delta = lse.new_empty(lse.shape)
    # the arguments both kernels take, in their order
    inputs = (cu_seqlens_q, cu_seqlens_k, *strides(q), *strides(k), *strides(v), *strides(grad_out))
    rows = (0, M) if packed else (H * M, M)  # L's and Dlt's strides
    sizes = (*((0, 0, Z) if packed else (M, N, 0)), scale, softcap, left, right)
    common = dict(
        BOUNDED_LEFT=bounded_left,
        BOUNDED_RIGHT=bounded_right,
        VARLEN=packed,
        HEAD_DIM=D,
        BLOCK_D=padded_head_dim(D),
        PRECISION=dot_precision(q.dtype),
        SOFTCAP=softcap > 0,
    )
    tiles = config.dq
    _launch_flash_backward_dq(traced)[_grid(M, tiles.block_m, H, Z, packed)](
        q,
        k,
        v,
        o,
        grad_out,
        lse,
        delta,
        dq,
        *inputs,
        *strides(o)[:3],
        *strides(dq)[:3],
        *rows,
        H,
        H // Hkv,
        *sizes,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **common,
    )
    tiles = config.dkdv
    _launch_flash_backward_dkdv(traced)[_grid(N, tiles.block_n, Hkv, Z, packed)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        dk,
        dv,
        *inputs,
        *strides(dk)[:3],
        *rows,
        Hkv,
        H // Hkv,
        *sizes,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **common,
    )
    return dq, dk, dv
