"""Rotary position embedding (RoPE) of queries and keys in one launch per direction.

    q, k (B, H, N, D), (B, Hkv, N, D); cos, sin (L >= N, D/2) fp32 tables; position p = index along N
    out[..., :D/2] = x1 cos_p - x2 sin_p,  out[..., D/2:] = x1 sin_p + x2 cos_p   (x1, x2 the halves)

The "rotate half" pairing (GPT-NeoX, Llama in Hugging Face), computed in fp32 and written in the
input's dtype, as `fastlm.layers.RotaryEmbedding` does it with PyTorch ops. The
backward is the same rotation by -angle (the rotation is orthogonal), so one kernel serves both.

Why a kernel: in eager mode the PyTorch version is about ten ops per tensor forward (casts, halves,
four products, a sum, a difference, a concatenation, a cast back) and more backward, each a
dispatch and a launch, on every layer; here a layer's q and k take one launch forward and one
backward. Under torch.compile Inductor fuses the PyTorch ops into the kernels around them, so the
model uses this op in eager mode only (its rope switch "auto").

Bytes (element size s): forward and backward read and write (H + Hkv) B N D s each, and read the
N x D/2 rows of cos and sin once per position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastlm.ops.common import (
    DTYPES,
    check_dtype,
    check_same_device,
    check_tensor,
    device_arch,
    next_power_of_2,
    runs_triton,
)
from fastlm.ops.launch import launcher

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    X, OUT,  # this position's first head of one input and of its output
    stride_xh, stride_xd, stride_oh, stride_od,
    cos, sin,  # (BLOCK_HALF,) fp32, this position's angles (sin already negated for the backward)
    HEADS, HALF,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    for h0 in range(0, HEADS, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)  # heads x head stride may pass 2^31
        mask = (heads[:, None] < HEADS) & col_mask[None, :]
        first = X + heads[:, None] * stride_xh + cols[None, :] * stride_xd
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
        out = OUT + heads[:, None] * stride_oh + cols[None, :] * stride_od
        tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(OUT.dtype.element_ty), mask=mask)
        tl.store(out + HALF * stride_od, (x1 * sin[None, :] + x2 * cos[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K,  # (B, H, N, D), (B, Hkv, N, D) inputs (the upstream gradients in the backward), any strides
    QO, KO,  # outputs of the same shapes, any strides
    COS, SIN,  # (L, D/2) fp32 tables, rows stride_cos / stride_sin, unit column stride
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_qob, stride_qoh, stride_qon, stride_qod,
    stride_kob, stride_koh, stride_kon, stride_kod,
    stride_cos, stride_sin,
    N, H, HKV, HALF,
    BACKWARD: tl.constexpr,  # rotate by -angle: the gradient of the rotation
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One program per (batch, position): grid (B * N,). It reads the position's cos and sin row
    once and rotates every query and key head there, BLOCK_H heads at a time."""
    pid = tl.program_id(0)
    b = (pid // N).to(tl.int64)
    n = (pid % N).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + n * stride_cos + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(SIN + n * stride_sin + cols, mask=cols < HALF, other=0.0)
    if BACKWARD:
        sin = -sin
    _rotate_heads(
        Q + b * stride_qb + n * stride_qn,
        QO + b * stride_qob + n * stride_qon,
        stride_qh,
        stride_qd,
        stride_qoh,
        stride_qod,
        cos,
        sin,
        H,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        K + b * stride_kb + n * stride_kn,
        KO + b * stride_kob + n * stride_kon,
        stride_kh,
        stride_kd,
        stride_koh,
        stride_kod,
        cos,
        sin,
        HKV,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
    )


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotaryConfig:
    """How a program covers its position's heads: BLOCK_H heads x BLOCK_HALF columns per step."""

    tile_elements: int  # BLOCK_H x BLOCK_HALF at most (BLOCK_H shrinks to fit, never below 1)
    num_warps: int

    def block_h(self, heads: int, block_half: int) -> int:
        return max(1, min(next_power_of_2(heads), self.tile_elements // block_half))


# By device_arch. Not swept: one program moves (H + Hkv) D elements in and out, a few KB, and
# 2048-element steps with 4 warps keep 16 values per thread in flight. GPUs nobody measured and
# the interpreter (0) take the sm90 entry.
_CONFIGS = {90: RotaryConfig(tile_elements=2048, num_warps=4)}
DEFAULT_CONFIG = _CONFIGS[90]


@functools.cache
def rotary_config(arch: int) -> RotaryConfig:
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# Launchers: rotated (q, k) into given outputs, for both directions
# ----------------------------------------------------------------------------------------------

_launch_rotary = launcher(_rotary_kernel)


def _rotate(q, k, cos, sin, qo, ko, backward: bool, config: RotaryConfig | None = None, traced: bool = False):
    """Writes q and k rotated (by -angle for ``backward``) into qo and ko (any strides) and returns them."""
    b, h, n, d = q.shape
    if q.numel() + k.numel() == 0:
        return qo, ko
    if not runs_triton(q):
        cos_n, sin_n = cos[:n], (-sin[:n] if backward else sin[:n])
        return qo.copy_(rotate_half(q, cos_n, sin_n)), ko.copy_(rotate_half(k, cos_n, sin_n))
    config = config or rotary_config(device_arch(q.device))
    half = d // 2
    block_half = next_power_of_2(half)
    _launch_rotary(traced)[(b * n,)](
        q,
        k,
        qo,
        ko,
        cos,
        sin,
        *q.stride(),
        *k.stride(),
        *qo.stride(),
        *ko.stride(),
        cos.stride(0),
        sin.stride(0),
        n,
        h,
        k.shape[1],
        half,
        BACKWARD=backward,
        BLOCK_H=config.block_h(max(h, k.shape[1]), block_half),
        BLOCK_HALF=block_half,
        num_warps=config.num_warps,
    )
    return qo, ko


def _new(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides when they lay it out densely in some dim order (a transposed view of a
    contiguous tensor: the model's heads), else None."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return t.stride()


def _gradient_like(grad: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """The input gradient's buffer: laid out like the forward's input where that was dense, so the
    views it was made from pass the gradient on without a copy; else contiguous."""
    if stride is None:
        return _new(grad)
    return torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::rotary_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, k, cos, sin, _new(q), _new(k), False, traced=True)


@torch.library.triton_op("fastlm::rotary_backward", mutates_args=())
def _backward_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(dq, dk, cos, sin, _new(dq), _new(dk), True, traced=True)


def _op_setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)  # the rotation's gradient reads neither q nor k


def _op_backward(ctx, dq, dk):
    dq, dk = _backward_op(dq, dk, *ctx.saved_tensors)
    return dq, dk, None, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


class RotaryFunction(torch.autograd.Function):
    """Eager path: ``RotaryFunction.apply(q, k, cos, sin, config)`` for checked inputs."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, config):
        ctx.save_for_backward(cos, sin)
        ctx.strides, ctx.config = (_dense_stride(q), _dense_stride(k)), config
        return _rotate(q, k, cos, sin, _new(q), _new(k), False, config)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's gradient is not itself differentiable
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        q_stride, k_stride = ctx.strides
        out = _rotate(dq, dk, cos, sin, _gradient_like(dq, q_stride), _gradient_like(dk, k_stride), True, ctx.config)
        return *out, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API and reference
# ----------------------------------------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(name, tensor)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, N, D), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"k must match q in batch, length and head dim, got {tuple(k.shape)} for q {tuple(q.shape)}")
    if d % 2:
        raise ValueError(f"head dim must be even (two halves rotate as pairs), got {d}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2 or cos.shape[0] < n:
        raise ValueError(
            f"cos and sin must be (L, D/2) = (L >= {n}, {d // 2}), got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    check_dtype("q", q, DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.stride(-1) != 1:
            raise TypeError(
                f"{name} must be an fp32 table with unit column stride, got {table.dtype}, strides {table.stride()}"
            )
        if table.requires_grad:
            raise ValueError(f"{name} must not require grad: the tables are constants and get no gradient")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of queries and keys (module docstring): q (B, H, N, D), k (B, Hkv, N, D), any strides,
    fp32 / fp16 / bf16; cos, sin (L >= N, D/2) fp32 with row p the angles of position p. Returns
    (q, k) rotated, contiguous, in their dtype; gradients flow to q and k."""
    check_inputs(q, k, cos, sin)
    if torch.compiler.is_compiling():
        return _forward_op(q, k, cos, sin)
    return RotaryFunction.apply(q, k, cos, sin, None)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation of one tensor in PyTorch ops: x (..., N, D), cos and sin (N, D/2) of any float
    dtype; computed in fp32 (float64 stays float64), returned in x's dtype. The model's PyTorch
    path, the fallback without Triton and the reference all run this."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    cos, sin = cos.to(compute), sin.to(compute)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def rotary_embedding_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_half` of q and k with rows 0..N-1 of the tables: what the kernel computes."""
    n = q.shape[2]
    return rotate_half(q, cos[:n], sin[:n]), rotate_half(k, cos[:n], sin[:n])
