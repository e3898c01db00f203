"""SwiGLU's gating, silu(gate) * up, in one launch per direction.

    gate, up (..., D), one shape;  y = silu(g) * u,  silu(g) = g s,  s = sigmoid(g) = 1 / (1 + exp(-g))

The activation of the gated MLP of Llama-style models (Shazeer, "GLU Variants Improve
Transformer", 2020): y = down(silu(x W_gate) * (x W_up)). SiLU, also called Swish, is Elfwing et
al. 2017 and Ramachandran et al. 2017. The backward, with ds/dg = s (1 - s):

    d silu / dg = s + g s (1 - s) = s (1 + g (1 - s))
    dg = dy u s (1 + g (1 - s)),    du = dy silu(g)

It recomputes s from the saved gate instead of saving silu(g): the forward saves only its inputs.
It takes s and 1 - s = sigmoid(-g) from exp(-|g|), which neither overflows nor cancels.

Cost (element size s_e, N = R D elements): the forward reads gate and up and writes y,
3 N s_e bytes; the backward reads dy, gate and up and writes dgate and dup, 5 N s_e bytes. FLOPs
per element, counting exp and div as 1: forward 5 (negate, exp, add, divide, multiply), backward
about 13: both directions are memory-bound by far.

Why a kernel: eager `F.silu(g) * u` is two launches forward that write silu(g) and read it back
(5 N s_e) and three backward (dy u, dy silu(g), silu's gradient: 9 N s_e), 14 N s_e in all against
8 N s_e here, so at the same bandwidth it takes 1.75x as long. Under torch.compile Inductor fuses
the PyTorch version as well as this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastlm.ops.common import (
    DTYPES,
    as_rows,
    cdiv,
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
def _swiglu_forward_kernel(
    GATE,  # (R, D) rows, row stride stride_gate, unit column stride
    UP,  # (R, D) rows, row stride stride_up, unit column stride
    OUT,  # (R, D) output, contiguous
    R, D, stride_gate, stride_up,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per program (a power of two)
):  # fmt: skip
    """One (BLOCK_R, BLOCK_D) tile per program: grid (cdiv(R, BLOCK_R), cdiv(D, BLOCK_D))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: R * D may pass 2^31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))  # as PyTorch computes it; exp(-g) = inf for g < -88 gives -0
    tl.store(OUT + rows[:, None] * D + cols[None, :], (silu * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    DY,  # (R, D) upstream gradient, row stride stride_dy, unit column stride
    GATE,  # (R, D) forward input, row stride stride_gate, unit column stride
    UP,  # (R, D) forward input, row stride stride_up, unit column stride
    DGATE,  # (R, D) gradient of gate, contiguous
    DUP,  # (R, D) gradient of up, contiguous
    R, D, stride_dy, stride_gate, stride_up,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per program (a power of two)
):  # fmt: skip
    """The forward's tiling; silu recomputed from gate (module docstring for the math)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.exp(-tl.abs(g))  # in (0, 1]: never overflows
    big = 1.0 / (1.0 + a)  # sigmoid(|g|) >= 1/2
    small = a * big  # sigmoid(-|g|) = 1 - big, without the cancellation of the difference
    s = tl.where(g >= 0, big, small)
    one_minus_s = tl.where(g >= 0, small, big)
    out = rows[:, None] * D + cols[None, :]
    tl.store(DGATE + out, (dy * u * s * (1.0 + g * one_minus_s)).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + out, (dy * g * s).to(DUP.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwigluConfig:
    """How both kernels tile (R, D): a program covers BLOCK_R rows x BLOCK_D columns. Frozen, so it
    can key caches; make a variant with `dataclasses.replace(config, tile_elements=16)`."""

    tile_elements: int  # BLOCK_R x BLOCK_D (a power of two), for rows at most block_d_max wide
    block_d_max: int  # widest BLOCK_D (a power of two); narrower rows stack tile_elements / BLOCK_D per program
    num_warps: int

    def __post_init__(self):
        for name in ("tile_elements", "block_d_max"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")

    def blocks(self, d: int) -> tuple[int, int]:
        """(BLOCK_R, BLOCK_D) for rows D wide. Bit operations and comparisons only, so a traced,
        symbolic D passes through."""
        block_d = max(1, min(next_power_of_2(d), self.block_d_max))
        return max(1, self.tile_elements // block_d), block_d


# By device_arch. H100 / H200 (90): measured on an H100 in bf16 at `fastlm bench swiglu`'s shapes
# (8192 x 8192 and 8192 x 14336) over tile_elements 1024..16384, block_d_max 1024..8192 and 4, 8, 16
# warps: one 8192-wide row per program with 16 warps (16 elements of each input per thread) was at
# or near the best in both directions; the same tile with 4 warps lost a quarter of the backward's
# bandwidth. GPUs nobody measured and the interpreter (0) take this entry.
_CONFIGS = {90: SwigluConfig(tile_elements=8192, block_d_max=8192, num_warps=16)}
DEFAULT_CONFIG = _CONFIGS[90]


@functools.cache
def swiglu_config(arch: int, dtype: torch.dtype) -> SwigluConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`: 90 for H100 / H200, 0
    for the interpreter) and ``dtype``; no entry depends on the dtype yet. Keyed on Python values
    only (a traced D is a SymInt): `SwigluConfig.blocks` applies D afterwards."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Function and the triton_ops
# ----------------------------------------------------------------------------------------------

_launch_swiglu_forward = launcher(_swiglu_forward_kernel)
_launch_swiglu_backward = launcher(_swiglu_backward_kernel)


def _forward(gate: torch.Tensor, up: torch.Tensor, config: SwigluConfig | None = None, traced: bool = False):
    """y (contiguous, gate's shape and dtype); ``config`` None picks it; ``traced`` inside the
    triton_op. Inputs are read through their row strides: the two halves of a fused projection
    (`x.chunk(2, -1)`) cost no copy; a strided last dim is copied (as_rows)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    if not runs_triton(gate):
        return out.copy_(swiglu_ref(gate, up))
    gate_rows, up_rows = as_rows(gate), as_rows(up)
    r, d = gate_rows.shape
    config = config or swiglu_config(device_arch(gate.device), gate.dtype)
    block_r, block_d = config.blocks(d)
    _launch_swiglu_forward(traced)[(cdiv(r, block_r), cdiv(d, block_d))](
        gate_rows,
        up_rows,
        out,
        r,
        d,
        gate_rows.stride(0),
        up_rows.stride(0),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=config.num_warps,
    )
    return out


def _backward(dy, gate, up, config: SwigluConfig | None = None, traced: bool = False):
    """(dgate, dup), contiguous, in gate's shape and dtype, from dy of any strides; ``config`` None
    picks it; ``traced`` inside the triton_op."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return dgate, dup
    if not runs_triton(gate):
        compute = torch.promote_types(gate.dtype, torch.float32)
        g, u, dy = gate.to(compute), up.to(compute), dy.to(compute)
        a = torch.exp(-g.abs())  # s and 1 - s as the kernel takes them
        big = 1 / (1 + a)
        small = a * big
        s, one_minus_s = torch.where(g >= 0, big, small), torch.where(g >= 0, small, big)
        return dgate.copy_(dy * u * s * (1 + g * one_minus_s)), dup.copy_(dy * g * s)
    dy_rows, gate_rows, up_rows = as_rows(dy), as_rows(gate), as_rows(up)
    r, d = gate_rows.shape
    config = config or swiglu_config(device_arch(gate.device), gate.dtype)
    block_r, block_d = config.blocks(d)
    _launch_swiglu_backward(traced)[(cdiv(r, block_r), cdiv(d, block_d))](
        dy_rows,
        gate_rows,
        up_rows,
        dgate,
        dup,
        r,
        d,
        dy_rows.stride(0),
        gate_rows.stride(0),
        up_rows.stride(0),
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=config.num_warps,
    )
    return dgate, dup


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::swiglu_forward", mutates_args=())
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up, traced=True)


@torch.library.triton_op("fastlm::swiglu_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up, traced=True)


def _op_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # gate and up: the backward recomputes silu(gate)


def _op_backward(ctx, dy):
    return _backward_op(dy, *ctx.saved_tensors)


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


class SwigluFunction(torch.autograd.Function):
    """Eager path: ``SwigluFunction.apply(gate, up, config)`` (config None to pick) for checked inputs."""

    @staticmethod
    def forward(ctx, gate, up, config):
        ctx.save_for_backward(gate, up)
        ctx.config = config
        return _forward(gate, up, config)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's gradient is not itself differentiable
    def backward(ctx, dy):
        return *_backward(dy, *ctx.saved_tensors, ctx.config), None


# ----------------------------------------------------------------------------------------------
# Public API and reference
# ----------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate and up (..., D) of one shape, dtype (fp32 / fp16 / bf16) and device,
    any row strides. Computed in fp32; returns a contiguous tensor in their dtype. Gradients flow
    to both."""
    check_tensor("gate", gate)
    check_tensor("up", up)
    if gate.dim() < 1:
        raise ValueError("gate must have at least one dimension (..., D), got a 0-dim tensor")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    check_dtype("gate", gate, DTYPES)
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)
    if torch.compiler.is_compiling():
        return _forward_op(gate, up)
    return SwigluFunction.apply(gate, up, None)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in fp32 (float64 stays float64), returned in gate's dtype: what the
    kernels compute, differentiable."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)
