"""The torch.library ops (traced), the autograd.Functions (eager), `flash_attention` and its reference.

One op pair serves dense and packed inputs (``cu_seqlens_q`` None or not), so torch.compile traces
either through the same kernels.
"""

from __future__ import annotations

import math

import torch

from fastlm.ops.common import (
    DTYPES,
    check_dtype,
    check_flag,
    check_number,
    check_same_device,
    check_tensor,
    device_arch,
    runs_triton,
)
from fastlm.ops.flash_attention.config import MAX_HEAD_DIM, AttentionConfig, attention_config
from fastlm.ops.flash_attention.launchers import _launch_backward, _launch_forward
from fastlm.ops.flash_attention.layout import kernel_ready_output
from fastlm.ops.flash_attention.masks import check_window, visible, window_bounds
from fastlm.ops.flash_attention.sdpa import sdpa_attention
from fastlm.ops.flash_attention.tiled import TORCH_TILE, _tiled_backward, _tiled_forward, as_4d, expand_kv


def _kernel_config(q: torch.Tensor, k: torch.Tensor, packed: bool, max_seqlen_k: int) -> AttentionConfig:
    """`attention_config` for q's GPU, dtype and head dim, and the keys of a head (packed: of the
    longest document)."""
    return attention_config(device_arch(q.device), q.dtype, q.shape[-1], max_seqlen_k if packed else k.shape[-2])


# ----------------------------------------------------------------------------------------------
# torch.library ops (traced), autograd.Functions (eager)
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) for dense q (Z, H, M, D) or (Z, M, D), k/v (Z, Hkv, N, D) or (Z, N, D), or packed
    (total, heads, D) with cumulative lengths: the kernels or, off the Triton path, the tiled twin."""
    packing = dict(
        window=(window_left, window_right), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softcap=softcap
    )
    if runs_triton(q):
        config = _kernel_config(q, k, cu_seqlens_q is not None, max_seqlen_k)
        return _launch_forward(q, k, v, causal, scale, config, traced=True, **packing)
    return _tiled_forward(q, k, v, causal, scale, TORCH_TILE, **packing)


@torch.library.triton_op("fastlm::flash_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_k: int,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packing = dict(
        window=(window_left, window_right), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softcap=softcap
    )
    if runs_triton(q):  # O and L as the op's caller passes them, made safe for the kernels' indexing
        config = _kernel_config(q, k, cu_seqlens_q is not None, max_seqlen_k)
        o, lse = kernel_ready_output(o), lse.contiguous()
        return _launch_backward(grad_out, q, k, v, o, lse, causal, scale, config, traced=True, **packing)
    return _tiled_backward(grad_out, q, k, v, o, lse, causal, scale, TORCH_TILE, **packing)


def _op_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options = inputs
    o, lse = output
    ctx.save_for_backward(lse, q, k, v, o, cu_seqlens_q, cu_seqlens_k)
    ctx.options = options  # max_seqlen_k, causal, scale, window_left, window_right, softcap


def _op_backward(ctx, grad_out, _grad_lse):
    lse, q, k, v, o, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
    return dq, dk, dv, *[None] * 8


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


def _autograd_forward(
    ctx, forward, q, k, v, causal: bool, scale: float, config, window, cu_seqlens_q, cu_seqlens_k, softcap: float
):
    """Shared forward of the autograd.Functions (``config``: the kernels' AttentionConfig or the
    twin's tile edge): saves exactly (L, Q, K, V, O), the cumulative lengths of packed inputs, and
    what the backward needs besides, so that it recomputes nothing."""
    packing = dict(window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, softcap=softcap)
    o, lse = forward(q, k, v, causal, scale, config, **packing)
    ctx.save_for_backward(lse, q, k, v, o, *(() if cu_seqlens_q is None else (cu_seqlens_q, cu_seqlens_k)))
    ctx.options = (causal, scale, window, softcap, config)
    return o


def _autograd_backward(ctx, backward, grad_out):
    lse, q, k, v, o, *packing = ctx.saved_tensors
    causal, scale, window, softcap, config = ctx.options
    cu_seqlens_q, cu_seqlens_k = packing or (None, None)
    dq, dk, dv = backward(
        grad_out,
        q,
        k,
        v,
        o,
        lse,
        causal,
        scale,
        config,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softcap=softcap,
    )
    return dq, dk, dv, *[None] * 8


class _FlashAttentionKernels(torch.autograd.Function):
    """The Triton kernels for inputs already checked: ``apply(q, k, v, causal, scale, config, window,
    cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softcap)`` with a bool, a float, an AttentionConfig or
    None (picked for q), a (left, right) window, for packed inputs the cumulative lengths and the
    longest document's keys (dense: None, None, 0), and the scores' softcap (0: none). The eager
    path of the public functions."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softcap=0.0):
        if config is None:  # picked here, not in the launcher: the backward reuses it
            config = _kernel_config(q, k, cu_seqlens_q is not None, max_seqlen_k)
        return _autograd_forward(
            ctx, _launch_forward, q, k, v, causal, scale, config, window, cu_seqlens_q, cu_seqlens_k, softcap
        )

    @staticmethod
    def backward(ctx, grad_out):
        return _autograd_backward(ctx, _launch_backward, grad_out)


class _FlashAttentionTiled(torch.autograd.Function):
    """The tiled twin for inputs already checked: ``apply(q, k, v, causal, scale, tile, window,
    cu_seqlens_q, cu_seqlens_k, softcap)``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, tile, window, cu_seqlens_q, cu_seqlens_k, softcap=0.0):
        return _autograd_forward(
            ctx, _tiled_forward, q, k, v, causal, scale, tile, window, cu_seqlens_q, cu_seqlens_k, softcap
        )

    @staticmethod
    def backward(ctx, grad_out):
        return _autograd_backward(ctx, _tiled_backward, grad_out)


class FlashAttentionTorch(_FlashAttentionTiled):
    """FlashAttention-2 tiled in plain PyTorch (tiles of TORCH_TILE, online softmax, backward from
    L and Dlt = rowsum(dO * O)). Runs on any device; the readable version of the kernels.

    ``apply(q, k, v, is_causal=False, scale=None, window=None)``; arguments as in ``flash_attention``,
    checked. Saves exactly (L, Q, K, V, O), L of shape (B, Nq) or (B, H, Nq) in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, window=None):
        check_inputs(q, k, v)
        scale = default_scale(q.shape[-1], scale)
        return _FlashAttentionTiled.forward(
            ctx, q, k, v, check_flag("is_causal", is_causal), scale, TORCH_TILE, check_window(window), None, None
        )


class FlashAttentionTriton(_FlashAttentionKernels):
    """FlashAttention-2 in Triton: the fast path. CUDA tensors, or CPU under TRITON_INTERPRET=1.

    ``apply(q, k, v, is_causal=False, scale=None, config=None, window=None)``; arguments as in
    ``flash_attention``, checked; ``config`` an AttentionConfig (None: ``attention_config`` for q's
    GPU, dtype, head dim and number of keys). Saves exactly (L, Q, K, V, O), L of shape (B, Nq) or
    (B, H, Nq) in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, config=None, window=None):
        if not runs_triton(q):
            raise ValueError(f"FlashAttentionTriton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {q.device}")
        check_inputs(q, k, v)
        scale = default_scale(q.shape[-1], scale)
        return _FlashAttentionKernels.forward(
            ctx, q, k, v, check_flag("is_causal", is_causal), scale, config, check_window(window), None, None, 0
        )


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    """One clear error for each way dense q, k, v can be wrong; the common case is checked first and cheaply."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, tensor)
    q_shape, k_shape = q.shape, k.shape
    rank = len(q_shape)
    if rank not in (3, 4):
        raise ValueError(f"q must be (B, N, D) or (B, H, N, D), got shape {tuple(q_shape)}")
    if len(k_shape) != rank or v.dim() != rank:
        raise ValueError(
            f"q, k and v must have the same number of dims, got {tuple(q_shape)}, {tuple(k_shape)}, {tuple(v.shape)}"
        )
    if k_shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v.shape)}")
    if q_shape[0] != k_shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q_shape[0]} and {k_shape[0]}")
    check_head_device_dtype(q, k, v, rank == 4, dtypes)


def check_head_device_dtype(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: bool, dtypes: tuple[torch.dtype, ...]
) -> None:
    """The checks dense and packed inputs share: one head dim in [1, MAX_HEAD_DIM], query heads a
    multiple of key/value heads (dim 1, where ``heads``), one device, one dtype among ``dtypes``."""
    q_shape, k_shape = q.shape, k.shape
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q_shape[-1]} and {k_shape[-1]}")
    if not 1 <= q_shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must lie in [1, {MAX_HEAD_DIM}] (the last dim of q, k, v), got {q_shape[-1]}")
    if heads and (q_shape[1] % k_shape[1] != 0 if k_shape[1] else q_shape[1] != 0):
        raise ValueError(
            f"query heads ({q_shape[1]}) must be a multiple of key/value heads ({k_shape[1]}) "
            "for grouped-query attention"
        )
    device = q.device
    if k.device != device or v.device != device:
        check_same_device(q=q, k=k, v=v)
    dtype = q.dtype
    if dtype not in dtypes or k.dtype != dtype or v.dtype != dtype:
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            check_dtype(name, tensor, dtypes)
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_softcap(softcap: float | None) -> float:
    """``softcap``, checked (a finite number > 0), or 0.0 (no softcap) for None."""
    return 0.0 if softcap is None else check_number("softcap", softcap, positive=True)


def default_scale(head_dim: int, scale: float | None) -> float:
    """``scale``, checked (a finite number > 0), or 1 / sqrt(head_dim) for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return check_number("scale", scale, positive=True)


def attend(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_k: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The output for checked arguments (dense: no cumulative lengths; softcap 0: none): while
    torch.compile traces, the op; eagerly, the kernels' autograd.Function, torch's SDPA on a CPU
    (sdpa.py; SDPA has no softcap), or the twin's autograd.Function elsewhere, for empty inputs
    and for softcapped scores on a CPU."""
    if torch.compiler.is_compiling():
        return _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, causal, scale, *window, softcap)[0]
    if runs_triton(q):
        return _FlashAttentionKernels.apply(
            q, k, v, causal, scale, None, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softcap
        )
    if q.device.type == "cpu" and q.numel() and k.numel() and not softcap:
        return sdpa_attention(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k)
    return _FlashAttentionTiled.apply(q, k, v, causal, scale, TORCH_TILE, window, cu_seqlens_q, cu_seqlens_k, softcap)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T [+ mask]) v without materializing the scores.

    Args:
        q: (B, Nq, D) or (B, H, Nq, D).
        k, v: (B, Nk, D) or (B, Hkv, Nk, D); H must be a multiple of Hkv (grouped-query attention).
        causal: query i sees key j iff j <= i + (Nk - Nq) (bottom-right aligned when Nq != Nk).
        scale: multiplies the scores; defaults to 1 / sqrt(D).
        window: (left, right) sliding window: query i sees key j iff p - left <= j <= p + right,
            p = i + (Nk - Nq) (and j <= p with ``causal``); -1 for a side without limit, None for
            no window. Tiles outside the window are skipped: the cost grows linearly in N.
        softcap: c > 0 softcaps the scaled scores to c * tanh(scores / c) before the mask and the
            softmax (Gemma 2's attn_logit_softcapping); None: no softcap.

    Query rows that see no key return 0. Returns the output with q's shape and dtype. fp32 inputs
    use TF32 matmuls only when ``torch.backends.cuda.matmul.allow_tf32`` is set, as torch's own
    matmuls do.
    """
    check_inputs(q, k, v)  # once: the autograd.Functions below take checked inputs
    causal, window = check_flag("causal", causal), check_window(window)
    return attend(q, k, v, causal, default_scale(q.shape[-1], scale), window, softcap=check_softcap(softcap))


def flash_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Materialized-scores reference with the semantics of ``flash_attention``, in fp32 (fp64 stays
    fp64); returns q's dtype promoted to at least fp32. Costs Nq x Nk memory."""
    check_inputs(q, k, v, dtypes=(*DTYPES, torch.float64))
    scale = default_scale(q.shape[-1], scale)
    softcap = check_softcap(softcap)
    left, right = window_bounds(check_flag("causal", causal), check_window(window))
    compute = torch.promote_types(q.dtype, torch.float32)
    q4, k4, v4 = (t.to(compute) for t in as_4d(q, k, v))
    k4, v4 = expand_kv(k4, q4.shape[1]), expand_kv(v4, q4.shape[1])
    s = q4 @ k4.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    M, N = q4.shape[2], k4.shape[2]
    positions = torch.arange(M, device=q.device) + (N - M)
    s = s.masked_fill(~visible(positions, torch.arange(N, device=q.device), left, right), float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(s.isneginf().all(-1, keepdim=True), 0.0)  # no visible key: 0
    out = p @ v4
    return out.squeeze(1) if q.dim() == 3 else out
