"""The gating of gated MLPs, act(gate) * up, in one launch per direction: SwiGLU (act = SiLU)
and GeGLU (act = GELU, exact or its tanh form).

    gate, up (..., D), one shape;  y = act(g) * u

SwiGLU is the MLP of Llama-style models, GeGLU Gemma's (Shazeer, "GLU Variants Improve
Transformer", 2020): y = down(act(x W_gate) * (x W_up)). SiLU, also called Swish, is Elfwing et al.
2017 and Ramachandran et al. 2017; GELU is Hendrycks and Gimpel 2016. With s = sigmoid(z) =
1 / (1 + exp(-z)) and ds/dz = s (1 - s):

    silu(g) = g s,  z = g:                 d silu / dg = s + g s (1 - s) = s (1 + g (1 - s))
    gelu_tanh(g) = g (1 + tanh(k)) / 2 = g s,  z = 2k = 2 sqrt(2/pi) (g + 0.044715 g^3):
                                           d gelu_tanh / dg = s + g s (1 - s) dz/dg
    gelu(g) = g Phi(g),  Phi(g) = (1 + erf(g / sqrt 2)) / 2:   d gelu / dg = Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi)
    dg = dy u act'(g),    du = dy act(g)

The tanh form is a sigmoid in disguise ((1 + tanh(k)) / 2 = sigmoid(2k)), so it shares SiLU's
sigmoid: no 1 + tanh(k) that cancels where g is very negative (PyTorch's form loses the bits there).
The backward recomputes the activation from the saved gate instead of saving act(g): the forward
saves only its inputs. It takes s and 1 - s = sigmoid(-z) from exp(-|z|), which neither overflows
nor cancels. The exact GELU is computed as PyTorch computes it, from erf.

Cost (element size s_e, N = R D elements): the forward reads gate and up and writes y,
3 N s_e bytes; the backward reads dy, gate and up and writes dgate and dup, 5 N s_e bytes. FLOPs
per element, counting exp, erf and div as 1: SiLU forward 5, backward about 13; GELU about twice
that: both directions are memory-bound by far.

Why a kernel: eager `F.silu(g) * u` is two launches forward that write silu(g) and read it back
(5 N s_e) and three backward (dy u, dy silu(g), silu's gradient: 9 N s_e), 14 N s_e in all against
8 N s_e here, so at the same bandwidth it takes 1.75x as long (GELU's likewise). Under
torch.compile Inductor fuses the PyTorch version as well as this.
"""

from __future__ import annotations

import functools
import math
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
from fastlm.ops.constants import GELU_CUBIC, INV_SQRT_2PI, SQRT_8_OVER_PI, SQRT_HALF
from fastlm.ops.launch import launcher

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """act(g) for fp32 g, as the forward computes it (module docstring)."""
    if ACTIVATION == "gelu":
        act = 0.5 * g * (1.0 + tl.math.erf(g * SQRT_HALF))  # as PyTorch computes it
    else:
        z = g if ACTIVATION == "silu" else SQRT_8_OVER_PI * (g + GELU_CUBIC * g * g * g)
        act = g / (1.0 + tl.exp(-z))  # as PyTorch computes silu; exp(-z) = inf for z < -88 gives -0
    return act


@triton.jit
def _activation_and_slope(g, ACTIVATION: tl.constexpr):
    """(act(g), d act / dg) for fp32 g, as the backward computes them (module docstring)."""
    if ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.math.erf(g * SQRT_HALF))
        act = g * cdf
        slope = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    else:
        z = g if ACTIVATION == "silu" else SQRT_8_OVER_PI * (g + GELU_CUBIC * g * g * g)
        a = tl.exp(-tl.abs(z))  # in (0, 1]: never overflows
        big = 1.0 / (1.0 + a)  # sigmoid(|z|) >= 1/2
        small = a * big  # sigmoid(-|z|) = 1 - big, without the cancellation of the difference
        s = tl.where(z >= 0, big, small)
        one_minus_s = tl.where(z >= 0, small, big)
        act = g * s
        if ACTIVATION == "silu":
            slope = s * (1.0 + g * one_minus_s)
        else:
            # dz/dg grows as g^2: where s (1 - s) underflows to 0 the term is 0, not 0 * inf
            dz = SQRT_8_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * g * g)
            curve = s * one_minus_s
            slope = s + tl.where(curve > 0.0, g * curve * dz, 0.0)
    return act, slope


@triton.jit
def _glu_forward_kernel(
    GATE,  # (R, D) rows, row stride stride_gate, unit column stride
    UP,  # (R, D) rows, row stride stride_up, unit column stride
    OUT,  # (R, D) output, contiguous
    R, D, stride_gate, stride_up,
    ACTIVATION: tl.constexpr,  # "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU)
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per program (a power of two)
):  # fmt: skip
    """One (BLOCK_R, BLOCK_D) tile per program: grid (cdiv(R, BLOCK_R), cdiv(D, BLOCK_D))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: R * D may pass 2^31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = _activation(g, ACTIVATION) * u
    tl.store(OUT + rows[:, None] * D + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    DY,  # (R, D) upstream gradient, row stride stride_dy, unit column stride
    GATE,  # (R, D) forward input, row stride stride_gate, unit column stride
    UP,  # (R, D) forward input, row stride stride_up, unit column stride
    DGATE,  # (R, D) gradient of gate, contiguous
    DUP,  # (R, D) gradient of up, contiguous
    R, D, stride_dy, stride_gate, stride_up,
    ACTIVATION: tl.constexpr,  # as the forward's
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # columns per program (a power of two)
):  # fmt: skip
    """The forward's tiling; the activation recomputed from gate (module docstring for the math)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation_and_slope(g, ACTIVATION)
    out = rows[:, None] * D + cols[None, :]
    tl.store(DGATE + out, (dy * u * slope).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + out, (dy * act).to(DUP.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwigluConfig:
    """How both kernels tile (R, D), for every activation: a program covers BLOCK_R rows x BLOCK_D
    columns. Frozen, so it can key caches; make a variant with
    `dataclasses.replace(config, tile_elements=16)`."""

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
# bandwidth. GeGLU takes the same tiles (memory-bound as well; not tuned of its own). GPUs nobody
# measured and the interpreter (0) take this entry.
_CONFIGS = {90: SwigluConfig(tile_elements=8192, block_d_max=8192, num_warps=16)}
DEFAULT_CONFIG = _CONFIGS[90]


@functools.cache
def swiglu_config(arch: int, dtype: torch.dtype) -> SwigluConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`: 90 for H100 / H200, 0
    for the interpreter) and ``dtype``; no entry depends on the dtype yet. Keyed on Python values
    only (a traced D is a SymInt): `SwigluConfig.blocks` applies D afterwards."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Functions and the triton_ops
# ----------------------------------------------------------------------------------------------

_launch_glu_forward = launcher(_glu_forward_kernel)
_launch_glu_backward = launcher(_glu_backward_kernel)

# geglu's ``approximate`` -> the kernels' ACTIVATION (and F.gelu's approximate for the same math)
GELU_ACTIVATIONS = {"tanh": "gelu_tanh", "none": "gelu"}
_GELU_APPROXIMATE = {activation: approximate for approximate, activation in GELU_ACTIVATIONS.items()}


def _forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str = "silu",
    config: SwigluConfig | None = None,
    traced: bool = False,
):
    """y = act(gate) * up (contiguous, gate's shape and dtype), ``activation`` one of the kernels'
    ACTIVATION values; ``config`` None picks it; ``traced`` inside the triton_op. Inputs are read
    through their row strides: the two halves of a fused projection (`x.chunk(2, -1)`) cost no
    copy; a strided last dim is copied (as_rows)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    if not runs_triton(gate):
        return out.copy_(_activation_torch(gate, activation) * up.to(_compute_dtype(gate)))
    gate_rows, up_rows = as_rows(gate), as_rows(up)
    r, d = gate_rows.shape
    config = config or swiglu_config(device_arch(gate.device), gate.dtype)
    block_r, block_d = config.blocks(d)
    _launch_glu_forward(traced)[(cdiv(r, block_r), cdiv(d, block_d))](
        gate_rows,
        up_rows,
        out,
        r,
        d,
        gate_rows.stride(0),
        up_rows.stride(0),
        ACTIVATION=activation,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=config.num_warps,
    )
    return out


def _backward(dy, gate, up, activation: str = "silu", config: SwigluConfig | None = None, traced: bool = False):
    """(dgate, dup), contiguous, in gate's shape and dtype, from dy of any strides; ``config`` None
    picks it; ``traced`` inside the triton_op."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return dgate, dup
    if not runs_triton(gate):
        compute = _compute_dtype(gate)
        act, slope = _activation_and_slope_torch(gate.to(compute), activation)
        dy = dy.to(compute)
        return dgate.copy_(dy * up.to(compute) * slope), dup.copy_(dy * act)
    dy_rows, gate_rows, up_rows = as_rows(dy), as_rows(gate), as_rows(up)
    r, d = gate_rows.shape
    config = config or swiglu_config(device_arch(gate.device), gate.dtype)
    block_r, block_d = config.blocks(d)
    _launch_glu_backward(traced)[(cdiv(r, block_r), cdiv(d, block_d))](
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
        ACTIVATION=activation,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=config.num_warps,
    )
    return dgate, dup


# The kernels' math in PyTorch, for the launchers' path where Triton does not run (fp32, float64 stays)


def _compute_dtype(gate: torch.Tensor) -> torch.dtype:
    return torch.promote_types(gate.dtype, torch.float32)


def _activation_torch(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) in the compute dtype, as PyTorch's own activations compute it."""
    g = gate.to(_compute_dtype(gate))
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate=_GELU_APPROXIMATE[activation])


def _activation_and_slope_torch(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), d act / dg) as `_activation_and_slope` computes them, g in the compute dtype."""
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * 0.5**0.5))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) * (2 * math.pi) ** -0.5
    z = g if activation == "silu" else (8 / math.pi) ** 0.5 * (g + 0.044715 * g * g * g)
    a = torch.exp(-z.abs())  # s and 1 - s as the kernel takes them
    big = 1 / (1 + a)
    small = a * big
    s, one_minus_s = torch.where(z >= 0, big, small), torch.where(z >= 0, small, big)
    if activation == "silu":
        return g * s, s * (1 + g * one_minus_s)
    curve = s * one_minus_s
    dz = (8 / math.pi) ** 0.5 * (1 + 3 * 0.044715 * g * g)
    return g * s, s + torch.where(curve > 0, g * curve * dz, 0.0)


# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::swiglu_forward", mutates_args=())
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up, traced=True)


@torch.library.triton_op("fastlm::swiglu_backward", mutates_args=())
def _backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up, traced=True)


@torch.library.triton_op("fastlm::geglu_forward", mutates_args=())
def _geglu_forward_op(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    return _forward(gate, up, GELU_ACTIVATIONS[approximate], traced=True)


@torch.library.triton_op("fastlm::geglu_backward", mutates_args=())
def _geglu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up, GELU_ACTIVATIONS[approximate], traced=True)


def _op_setup_context(ctx, inputs, output):
    """Both ops: the backward recomputes the activation from gate, so gate and up are all it saves."""
    ctx.save_for_backward(*inputs[:2])
    ctx.other_inputs = inputs[2:]  # geglu's (approximate,); () for swiglu


def _op_backward(ctx, dy):
    return _backward_op(dy, *ctx.saved_tensors)


def _geglu_op_backward(ctx, dy):
    return *_geglu_backward_op(dy, *ctx.saved_tensors, *ctx.other_inputs), None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)
torch.library.register_autograd(_geglu_forward_op, _geglu_op_backward, setup_context=_op_setup_context)


class GatedFunction(torch.autograd.Function):
    """Eager path: ``GatedFunction.apply(gate, up, activation, config)`` (activation a kernel
    ACTIVATION value, config None to pick) for checked inputs."""

    @staticmethod
    def forward(ctx, gate, up, activation, config):
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.config = activation, config
        return _forward(gate, up, activation, config)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's gradient is not itself differentiable
    def backward(ctx, dy):
        return *_backward(dy, *ctx.saved_tensors, ctx.activation, ctx.config), None, None


# ----------------------------------------------------------------------------------------------
# Public API and reference
# ----------------------------------------------------------------------------------------------


def _check_inputs(gate: torch.Tensor, up: torch.Tensor) -> None:
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


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: gate and up (..., D) of one shape, dtype (fp32 / fp16 / bf16) and device,
    any row strides. Computed in fp32; returns a contiguous tensor in their dtype. Gradients flow
    to both."""
    _check_inputs(gate, up)
    if torch.compiler.is_compiling():
        return _forward_op(gate, up)
    return GatedFunction.apply(gate, up, "silu", None)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up, with ``approximate`` as `torch.nn.functional.gelu` takes it: "tanh" (the
    tanh form, Gemma's gelu_pytorch_tanh) or "none" (the exact, erf form). gate and up (..., D) of
    one shape, dtype (fp32 / fp16 / bf16) and device, any row strides. Computed in fp32; returns a
    contiguous tensor in their dtype. Gradients flow to both."""
    _check_inputs(gate, up)
    if approximate not in GELU_ACTIVATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if torch.compiler.is_compiling():
        return _geglu_forward_op(gate, up, approximate)
    return GatedFunction.apply(gate, up, GELU_ACTIVATIONS[approximate], None)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in fp32 (float64 stays float64), returned in gate's dtype: what the
    kernels compute, differentiable."""
    compute = _compute_dtype(gate)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """`F.gelu(gate, approximate=approximate) * up` in fp32 (float64 stays float64), returned in
    gate's dtype: what the kernels compute, differentiable."""
    compute = _compute_dtype(gate)
    return (F.gelu(gate.to(compute), approximate=approximate) * up.to(compute)).to(gate.dtype)
