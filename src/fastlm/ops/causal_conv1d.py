"""Depthwise causal conv1d over channels-last sequences: fused Triton forward and backward, and a
CUDA C++ forward (`backend="cuda"`) built on first use.

    u (B, L, D), weight (D, K), bias (D,), out (B, L, D):
    z[b, l, d] = bias[d] + sum_k weight[d, k] * u[b, l - (K - 1) + k, d]     (u = 0 before l = 0)
    out = z, or silu(z) = z * sigmoid(z) with activation="silu"

The left zero padding is a load mask, never a padded copy. Backward, with dz = dout (no
activation) or dout * silu'(z) (z recomputed from u, not stored):

    du[b, l, d]  = sum_j weight[d, K - 1 - j] * dz[b, l + j, d]
    dweight[d, k] = sum_{b, l} dz[b, l, d] * u[b, l - (K - 1) + k, d]
    dbias[d]     = sum_{b, l} dz[b, l, d]

Programs own a (BLOCK_L, BLOCK_D) tile (forward, backward part 2) or a column block of a chunk of
rows (backward part 1), so the K shifted reads of a row hit the cache; weight and bias gradients
are summed per program into (programs, D, K) / (programs, D) fp32 partials and reduced
deterministically, no atomics. The backward computes dz once per row (part 1, which writes it with
SILU) and du from it (part 2): one kernel that recomputed z at the K shifts of every row needed
K x K loads per element and, at K = 4, 255 registers and spills (Nsight Compute on an H100: 1.2 GB
written for a 134 MB du).

Bytes (minimum, element size s): forward B*L*D*s read + B*L*D*s written; backward u and dout read,
du written: 3*B*L*D*s (plus the small weight and bias). The two-part backward moves 5*B*L*D*s with
SILU (dz written and read back) and 4*B*L*D*s without (dout read twice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastlm.ops.common import (
    DTYPES,
    cdiv,
    check_dtype,
    check_optional_tensor,
    check_same_device,
    check_tensor,
    device_arch,
    next_power_of_2,
    runs_triton,
)
from fastlm.ops.launch import launcher

MAX_KERNEL_SIZE = 8
ACTIVATIONS = (None, "silu")
BACKENDS = ("triton", "cuda")


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _shifted(U, base, rows, cols, shift, L, stride_l, col_mask):
    """u[rows + shift, cols] as fp32, 0 outside [0, L) (the causal zero padding)."""
    src = rows + shift
    mask = ((src >= 0) & (src < L))[:, None] & col_mask[None, :]
    return tl.load(U + base + src[:, None] * stride_l + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _conv(
    U,
    W,
    BIAS,
    base,
    rows,
    cols,
    col_mask,
    shift,
    L,
    stride_ul,
    stride_wd,
    stride_wk,
    stride_bias,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """z at rows + shift: bias + sum_k w[:, k] * u[rows + shift - (K - 1) + k]."""
    w = tl.load(W + cols * stride_wd, mask=col_mask, other=0.0).to(tl.float32)
    z = w[None, :] * _shifted(U, base, rows, cols, shift - (K - 1), L, stride_ul, col_mask)
    for k in tl.static_range(1, K):
        w = tl.load(W + cols * stride_wd + k * stride_wk, mask=col_mask, other=0.0).to(tl.float32)
        z += w[None, :] * _shifted(U, base, rows, cols, shift - (K - 1) + k, L, stride_ul, col_mask)
    if HAS_BIAS:
        z += tl.load(BIAS + cols * stride_bias, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _conv1d_forward_kernel(
    U, W, BIAS, OUT,  # u (B, L, D) with unit stride in D; weight (D, K); bias (D,); out (B, L, D) contiguous
    L, D, stride_ub, stride_ul, stride_wd, stride_wk, stride_bias,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)  # int64: L * D may pass 2^31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    batch = tl.program_id(2).to(tl.int64)
    col_mask = cols < D
    z = _conv(
        U,
        W,
        BIAS,
        batch * stride_ub,
        rows,
        cols,
        col_mask,
        0,
        L,
        stride_ul,
        stride_wd,
        stride_wk,
        stride_bias,
        K,
        HAS_BIAS,
    )
    if SILU:
        z = z * tl.sigmoid(z)
    out = OUT + batch * L * D + rows[:, None] * D + cols[None, :]
    tl.store(out, z.to(OUT.dtype.element_ty), mask=(rows < L)[:, None] & col_mask[None, :])


@triton.jit
def _conv1d_dz_kernel(
    U, W, BIAS, DOUT, DZ,  # dout (B, L, D) unit stride in D; dz (B, L, D) contiguous, written with SILU only
    DW_PARTIAL,  # (programs, D, K) fp32, program = batch * chunks + chunk: sums to dweight's (D, K) layout
    DB_PARTIAL,  # (programs, D) fp32
    L, D, stride_ub, stride_ul, stride_wd, stride_wk, stride_bias, stride_ob, stride_ol,
    K: tl.constexpr, K_POW2: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_L: tl.constexpr,
):  # fmt: skip
    """Backward, part 1: dz (with SILU) and this program's weight / bias gradient partials over a
    column block of CHUNK_L rows. Each row's dz is computed once; part 2 reads it K times."""
    chunk, batch = tl.program_id(0), tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    u_base, dout_base = batch * stride_ub, batch * stride_ob
    taps = tl.arange(0, K_POW2)
    dw = tl.zeros((K_POW2, BLOCK_D), tl.float32)
    db = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(chunk * CHUNK_L, tl.minimum(chunk * CHUNK_L + CHUNK_L, L), BLOCK_L):
        rows = tl.cast(start, tl.int64) + tl.arange(0, BLOCK_L)  # int64: L * D may pass 2^31
        dz = _shifted(DOUT, dout_base, rows, cols, 0, L, stride_ol, col_mask)
        if SILU:  # dz = dout * silu'(z), z recomputed from u
            z = _conv(
                U,
                W,
                BIAS,
                u_base,
                rows,
                cols,
                col_mask,
                0,
                L,
                stride_ul,
                stride_wd,
                stride_wk,
                stride_bias,
                K,
                HAS_BIAS,
            )
            sig = tl.sigmoid(z)
            dz = dz * sig * (1.0 + z * (1.0 - sig))
            dz_ptr = DZ + batch * L * D + rows[:, None] * D + cols[None, :]
            tl.store(dz_ptr, dz.to(DZ.dtype.element_ty), mask=(rows < L)[:, None] & col_mask[None, :])
        if BIAS_GRAD:
            db += tl.sum(dz, axis=0)
        if WEIGHT_GRAD:  # the shifted u tiles were just loaded by _conv: these reads hit the cache
            for k in tl.static_range(K):
                u = _shifted(U, u_base, rows, cols, k - (K - 1), L, stride_ul, col_mask)
                dw += tl.where(taps[:, None] == k, tl.sum(dz * u, axis=0)[None, :], 0.0)
    program = batch * tl.num_programs(0) + chunk
    if WEIGHT_GRAD:
        dw_ptr = DW_PARTIAL + program * D * K + cols[None, :] * K + taps[:, None]  # one block of BLOCK_D * K
        tl.store(dw_ptr, dw, mask=(taps < K)[:, None] & col_mask[None, :])
    if BIAS_GRAD:
        tl.store(DB_PARTIAL + program * D + cols, db, mask=col_mask)


@triton.jit
def _conv1d_input_grad_kernel(
    DZ, W, DU,  # dz (B, L, D) unit stride in D (dout itself without SILU); weight (D, K); du (B, L, D) contiguous
    L, D, stride_zb, stride_zl, stride_wd, stride_wk,
    K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Backward, part 2: du(l) = sum_j w[:, K - 1 - j] * dz(l + j), dz = 0 past the end; tiled like
    the forward, so the K shifted reads of a row hit the cache."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    batch = tl.program_id(2).to(tl.int64)
    col_mask = cols < D
    du = tl.zeros((BLOCK_L, BLOCK_D), tl.float32)
    for j in tl.static_range(K):
        w = tl.load(W + cols * stride_wd + (K - 1 - j) * stride_wk, mask=col_mask, other=0.0).to(tl.float32)
        du += w[None, :] * _shifted(DZ, batch * stride_zb, rows, cols, j, L, stride_zl, col_mask)
    du_ptr = DU + batch * L * D + rows[:, None] * D + cols[None, :]
    tl.store(du_ptr, du.to(DU.dtype.element_ty), mask=(rows < L)[:, None] & col_mask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conv1dConfig:
    """Tiles and warps of the three kernels: the forward and backward part 2 (du) share one
    (BLOCK_L, BLOCK_D) tile; part 1 (dz, weight / bias partials) has its own, over chunks of rows."""

    forward_block_l: int  # positions per forward / du tile (a power of two)
    forward_block_d: int  # channels per forward / du tile (a power of two)
    forward_warps: int  # warps per forward / du program
    backward_block_l: int  # positions per step of a part-1 program (a power of two)
    backward_block_d: int  # channels per part-1 program (a power of two)
    backward_warps: int  # warps per part-1 program
    backward_chunk_l: int  # positions per part-1 program: the partials are (B * L / this, D, K)

    def __post_init__(self):
        if self.backward_chunk_l % self.backward_block_l:  # a step must not cross into the next program's rows
            raise ValueError(
                f"backward_chunk_l ({self.backward_chunk_l}) must be a multiple of backward_block_l "
                f"({self.backward_block_l})"
            )


# By device_arch. H100 / H200 (90): backward part 1 from benchmarks/tune_conv1d.py on an H100, the
# best geometric mean over the two `fastlm bench conv1d` shapes, well ahead of the forward's
# 32 x 128 tile with 4 warps (benchmarks/results/conv1d_tuning_h100.jsonl, the records marked
# "two-part"); the forward's tile is not swept.
_CONFIGS = {
    90: Conv1dConfig(
        forward_block_l=32,
        forward_block_d=128,
        forward_warps=4,
        backward_block_l=64,
        backward_block_d=64,
        backward_warps=2,
        backward_chunk_l=512,
    ),
}
DEFAULT_CONFIG = _CONFIGS[90]  # GPUs nobody measured, and the interpreter (0)


@functools.cache
def causal_conv1d_config(arch: int, dtype: torch.dtype) -> Conv1dConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`) and ``dtype``; no
    entry depends on the dtype or the shape (the sweep's two shapes agreed). Cached: one dict
    lookup per call; sizes stay out of the key, since inside the triton_op they may be SymInts."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Function and the triton_ops
# ----------------------------------------------------------------------------------------------

_launch_conv1d_forward = launcher(_conv1d_forward_kernel)
_launch_conv1d_dz = launcher(_conv1d_dz_kernel)
_launch_conv1d_input_grad = launcher(_conv1d_input_grad_kernel)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride in D: with a strided D every load of the kernels would be a gather, so
    such an input is copied once (weight and bias are small and read through their strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward(u, weight, bias, silu: bool, config: Conv1dConfig | None = None, traced: bool = False) -> torch.Tensor:
    """out (B, L, D) contiguous in u's dtype; ``config`` None picks it; ``traced`` inside the triton_op."""
    if not runs_triton(u):
        return _reference(u, weight, bias, "silu" if silu else None).to(u.dtype)
    u = _unit_stride(u)
    batch, length, d = u.shape
    out = torch.empty((batch, length, d), dtype=u.dtype, device=u.device)
    if out.numel() == 0:
        return out
    config = config or causal_conv1d_config(device_arch(u.device), u.dtype)
    grid = (cdiv(length, config.forward_block_l), cdiv(d, config.forward_block_d), batch)
    _launch_conv1d_forward(traced)[grid](
        u,
        weight,
        bias if bias is not None else weight,
        out,
        length,
        d,
        u.stride(0),
        u.stride(1),
        *weight.stride(),
        bias.stride(0) if bias is not None else 0,
        K=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_L=config.forward_block_l,
        BLOCK_D=config.forward_block_d,
        num_warps=config.forward_warps,
    )
    return out


def _backward(
    dout,
    u,
    weight,
    bias,
    silu: bool,
    weight_grad: bool,
    bias_grad: bool,
    config: Conv1dConfig | None = None,
    traced: bool = False,
):
    """(du, dweight or None, dbias or None); ``config`` None picks it; ``traced`` inside the
    triton_op. Two launches: dz and the weight / bias partials, then du from dz (dout itself without
    SILU, and part 1 is skipped when it has nothing to do); then one sum (and cast) per parameter
    gradient. With SILU, dz is stored in u's dtype, as PyTorch's own SiLU backward hands its
    gradient to the conv."""
    if not runs_triton(u):
        return _reference_backward(dout, u, weight, bias, silu, weight_grad, bias_grad)
    u, dout = _unit_stride(u), _unit_stride(dout)
    batch, length, d = u.shape
    k = weight.shape[1]
    du = torch.empty((batch, length, d), dtype=u.dtype, device=u.device)
    if du.numel() == 0:
        dw = torch.zeros_like(weight) if weight_grad else None
        return du, dw, (torch.zeros_like(bias) if bias_grad else None)
    config = config or causal_conv1d_config(device_arch(u.device), u.dtype)
    chunks = cdiv(length, config.backward_chunk_l)
    programs = batch * chunks
    dz = torch.empty_like(du) if silu else dout
    # every program writes its whole block of partials, so empty suffices
    dw_partial = torch.empty((programs, d, k), dtype=torch.float32, device=u.device) if weight_grad else du
    db_partial = torch.empty((programs, d), dtype=torch.float32, device=u.device) if bias_grad else du
    if silu or weight_grad or bias_grad:
        grid = (chunks, cdiv(d, config.backward_block_d), batch)
        _launch_conv1d_dz(traced)[grid](
            u,
            weight,
            bias if bias is not None else weight,
            dout,
            dz,
            dw_partial,
            db_partial,
            length,
            d,
            u.stride(0),
            u.stride(1),
            *weight.stride(),
            bias.stride(0) if bias is not None else 0,
            dout.stride(0),
            dout.stride(1),
            K=k,
            K_POW2=next_power_of_2(k),
            HAS_BIAS=bias is not None,
            SILU=silu,
            WEIGHT_GRAD=weight_grad,
            BIAS_GRAD=bias_grad,
            BLOCK_L=config.backward_block_l,
            BLOCK_D=config.backward_block_d,
            CHUNK_L=config.backward_chunk_l,
            num_warps=config.backward_warps,
        )
    grid = (cdiv(length, config.forward_block_l), cdiv(d, config.forward_block_d), batch)
    _launch_conv1d_input_grad(traced)[grid](
        dz,
        weight,
        du,
        length,
        d,
        dz.stride(0),
        dz.stride(1),
        *weight.stride(),
        K=k,
        BLOCK_L=config.forward_block_l,
        BLOCK_D=config.forward_block_d,
        num_warps=config.forward_warps,
    )
    dw = dw_partial.sum(dim=0).to(weight.dtype) if weight_grad else None
    db = db_partial.sum(dim=0).to(bias.dtype) if bias_grad else None
    return du, dw, db


def _reference(u, weight, bias=None, activation=None):
    """fp32 (fp64 for fp64 input) PyTorch: F.conv1d with groups=D over a left-padded sequence."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    if u.numel() == 0:  # F.conv1d takes no empty sequence (L = 0) and no 0 groups (D = 0)
        empty = u.to(dtype) * weight.to(dtype).sum(1)  # (B, L, D), still a function of u and weight
        return empty if bias is None else empty + bias.to(dtype)
    k = weight.shape[1]
    x = torch.nn.functional.pad(u.to(dtype).transpose(1, 2), (k - 1, 0))  # (B, D, L + K - 1)
    z = torch.nn.functional.conv1d(
        x, weight.to(dtype).unsqueeze(1), None if bias is None else bias.to(dtype), groups=u.shape[-1]
    )
    z = z.transpose(1, 2).contiguous()
    return torch.nn.functional.silu(z) if activation == "silu" else z


def _reference_backward(dout, u, weight, bias, silu, weight_grad, bias_grad):
    """The backward formulas of the module docstring in PyTorch (no autograd, so it also runs inside
    the backward op under torch.compile)."""
    if u.numel() == 0:  # as the Triton path: no output, so zero gradients (and F.conv1d would refuse)
        dw = torch.zeros_like(weight) if weight_grad else None
        return torch.zeros_like(u), dw, (torch.zeros_like(bias) if bias_grad else None)
    dtype = torch.promote_types(u.dtype, torch.float32)
    length, k = u.shape[1], weight.shape[1]
    dz = dout.to(dtype)
    if silu:
        z = _reference(u, weight, bias)
        sig = torch.sigmoid(z)
        dz = dz * sig * (1 + z * (1 - sig))
    # du(l) = sum_j w[:, K - 1 - j] dz(l + j): a conv of the right-padded dz with the flipped taps
    dz_t = dz.transpose(1, 2)  # (B, D, L)
    du = (
        torch.nn.functional.conv1d(
            torch.nn.functional.pad(dz_t, (0, k - 1)), weight.to(dtype).flip(1).unsqueeze(1), groups=u.shape[-1]
        )
        .transpose(1, 2)
        .contiguous()
    )
    dw = db = None
    if weight_grad:
        padded = torch.nn.functional.pad(u.to(dtype).transpose(1, 2), (k - 1, 0))  # (B, D, L + K - 1)
        dw = torch.stack([(dz_t * padded[..., j : j + length]).sum(dim=(0, 2)) for j in range(k)], dim=1)
        dw = dw.contiguous().to(weight.dtype)
    if bias_grad:
        db = dz.sum(dim=(0, 1)).to(bias.dtype)
    return du.to(u.dtype), dw, db


# ----------------------------------------------------------------------------------------------
# CUDA C++ forward
# ----------------------------------------------------------------------------------------------


def _cuda_forward(u, weight, bias, silu: bool) -> torch.Tensor:
    from fastlm.ops.csrc import load_causal_conv1d

    return load_causal_conv1d().forward(u.contiguous(), weight.contiguous(), bias, silu)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::causal_conv1d_forward", mutates_args=())
def _forward_op(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    return _forward(u, weight, bias, silu, traced=True)


@torch.library.triton_op("fastlm::causal_conv1d_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(du, dweight, dbias); dweight / dbias are empty tensors when not requested."""
    du, dw, db = _backward(dout, u, weight, bias, silu, weight_grad, bias_grad, traced=True)
    empty = u.new_empty(0)
    return du, (empty if dw is None else dw), (empty if db is None else db)


def _op_setup_context(ctx, inputs, output):
    u, weight, bias, silu = inputs
    ctx.save_for_backward(u, weight, bias)
    ctx.silu = silu


def _op_backward(ctx, dout):
    u, weight, bias = ctx.saved_tensors
    weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    du, dw, db = _backward_op(dout, u, weight, bias, ctx.silu, weight_grad, bias_grad)
    return du, (dw if weight_grad else None), (db if bias_grad else None), None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


class CausalConv1dFunction(torch.autograd.Function):
    """Eager path: ``CausalConv1dFunction.apply(u, weight, bias, silu, backend, config)``, the
    launchers behind a plain autograd.Function; ``backend`` picks the forward. The inputs were
    checked by the public function, and the backward checks nothing again."""

    @staticmethod
    def forward(ctx, u, weight, bias, silu, backend, config):
        ctx.save_for_backward(u, weight, bias)
        ctx.silu, ctx.config = silu, config
        if backend == "cuda":
            return _cuda_forward(u, weight, bias, silu)
        return _forward(u, weight, bias, silu, config)

    @staticmethod
    def backward(ctx, dout):
        u, weight, bias = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        du, dw, db = _backward(dout, u, weight, bias, ctx.silu, weight_grad, bias_grad, ctx.config)
        return du, dw, db, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(u, weight, bias, activation, backend) -> None:
    """One clear error for each bad argument."""
    check_tensor("u", u)
    check_tensor("weight", weight)
    check_optional_tensor("bias", bias)
    if u.dim() != 3:
        raise ValueError(f"u must have shape (B, L, D), got {tuple(u.shape)}")
    if weight.dim() != 2 or weight.shape[0] != u.shape[2]:
        raise ValueError(
            f"weight must have shape (D, K) = ({u.shape[2]}, K) to match u {tuple(u.shape)}, got {tuple(weight.shape)}"
        )
    if not 1 <= weight.shape[1] <= MAX_KERNEL_SIZE:
        raise ValueError(f"weight's kernel size K must be 1 to {MAX_KERNEL_SIZE}, got {weight.shape[1]}")
    if u.shape[0] > 65535:  # the batch is a grid axis
        raise ValueError(f"u may hold at most 65535 sequences, got {u.shape[0]}")
    if bias is not None and bias.shape != (u.shape[2],):
        raise ValueError(f"bias must have shape ({u.shape[2]},), got {tuple(bias.shape)}")
    if activation is not None and not (isinstance(activation, str) and activation in ACTIVATIONS):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if not (isinstance(backend, str) and backend in BACKENDS):
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "cuda" and not u.is_cuda:
        raise ValueError("backend='cuda' needs CUDA tensors")
    for name, tensor in (("u", u), ("weight", weight), ("bias", bias)):
        if tensor is not None:
            check_dtype(name, tensor, DTYPES)
    check_same_device(u=u, weight=weight, **({"bias": bias} if bias is not None else {}))


def causal_conv1d(
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: str = "triton",
) -> torch.Tensor:
    """Depthwise causal conv over L of channels-last u (B, L, D) with weight (D, K), optional bias
    (D,) and activation None or "silu"; output (B, L, D) in u's dtype (math in fp32). ``backend``
    "cuda" runs the forward as a CUDA C++ kernel (compiled on first use); the backward is Triton."""
    check_inputs(u, weight, bias, activation, backend)
    silu = activation == "silu"
    if torch.compiler.is_compiling() and backend == "triton":
        return _forward_op(u, weight, bias, silu)
    return CausalConv1dFunction.apply(u, weight, bias, silu, backend, None)


def causal_conv1d_ref(u, weight, bias=None, activation=None):
    """Plain PyTorch (F.conv1d, groups=D) in fp32 (fp64 for fp64 input), autograd through it."""
    return _reference(u, weight, bias, activation).to(u.dtype)
