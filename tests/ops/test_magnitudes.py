"""Every op at least as accurate as PyTorch's own op, against float64, across magnitudes and dtypes.

Each case runs fastlm and the PyTorch op on the same inputs, rounded to the dtype and moved by a
common offset, through `check_against_float64` (the PyTorch op in float64 is the truth): the output
and the gradient of every input, for an upstream gradient rounded to the output's dtype. fastlm's
normwise error must not pass torch's by more than TOLERANCE[dtype]: 1e-6 in fp32; in bf16 / fp16
an eighth of the dtype's unit roundoff, because both results are rounded to the dtype at different
points (torch after each op of a composite, fastlm where a kernel stores in the input's dtype), and
either can land a fraction of a rounding closer (truncating instead of rounding would exceed it).
Attention in bf16 / fp16 rounds P and dS to the input dtype before their matmuls, as FlashAttention
does on tensor cores, where torch's CPU attention keeps them in fp32: it gets a quarter of the unit
roundoff.

Offsets: the ops that are invariant to a common shift of their inputs (cross-entropy, softmax)
take the dtype's whole range (1e6 in fp32 and bf16; fp16 ends at 65504). The others take offsets
at which a row of N(offset, 1) still holds distinct values and its sums stay finite: up to 1e6 in
fp32, 1e2 in bf16 (8 bits of mantissa), 1e3 in fp16.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.ops.weighted_sum import weighted_sum

from .reference import check_against_float64, unit_roundoff
from .test_layer_norm import one_plus_weight_rms_norm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHIFTS = {"fp32": (0.0, 1e3, 1e4, 1e6), "bf16": (0.0, 1e3, 1e4, 1e6), "fp16": (0.0, 1e3, 1e4)}
VALUES = {"fp32": (0.0, 1e3, 1e4, 1e6), "bf16": (0.0, 1e1, 1e2), "fp16": (0.0, 1e2, 1e3)}
TOLERANCE = {"fp32": 1e-6, "bf16": unit_roundoff(torch.bfloat16) / 8, "fp16": unit_roundoff(torch.float16) / 8}
TARGETS = torch.randint(0, 37, (6,), generator=torch.Generator().manual_seed(1))


@dataclass(frozen=True)
class Case:
    shapes: tuple  # input shapes; input 0 (or `offset_input`) takes the offset
    fastlm: Callable
    torch: Callable  # the same math in PyTorch: in the dtype for the comparison, in float64 for the truth
    shift_invariant: bool = False  # offsets over the dtype's range (SHIFTS), else VALUES
    offset_input: int = 0
    unit_upstream: bool = False  # backward from an upstream gradient of 1 (loss.backward())
    gradients_at_offset: tuple | None = None  # inputs whose gradients are compared at offsets != 0 (None: all)
    tolerance_factor: float = 1.0  # times TOLERANCE in bf16 / fp16 (attention: 2)


def _smoothed_z_loss(logits, targets):
    """cross-entropy with label smoothing 0.1 plus 1e-4 * logsumexp^2 per row, in torch ops."""
    loss = F.cross_entropy(logits, targets, reduction="none", label_smoothing=0.1)
    return loss + 1e-4 * torch.logsumexp(logits, dim=-1) ** 2


def _causal_conv(u, weight, bias):
    """depthwise causal conv + SiLU with F.conv1d over the left-padded sequence; u (B, L, D)."""
    padded = F.pad(u.transpose(1, 2), (weight.shape[1] - 1, 0))
    return F.silu(F.conv1d(padded, weight.unsqueeze(1), bias, groups=u.shape[2]).transpose(1, 2))


CASES = {
    # the training path: the fused kernel, a summed loss, loss.backward(); (with another upstream
    # gradient, 16-bit gradients are rounded twice: see docs/cross_entropy.md)
    "cross_entropy fused": Case(
        ((6, 37),), lambda x: fastlm.cross_entropy(x, TARGETS.to(x.device), reduction="sum"),
        lambda x: F.cross_entropy(x, TARGETS.to(x.device), reduction="sum"), shift_invariant=True, unit_upstream=True),
    "cross_entropy recompute, smoothing, z-loss": Case(
        ((6, 37),), lambda x: fastlm.cross_entropy(x, TARGETS.to(x.device), reduction="none", label_smoothing=0.1,
                                                   z_loss=1e-4, fused=False),
        lambda x: _smoothed_z_loss(x, TARGETS.to(x.device)), shift_invariant=True),
    "masked_softmax": Case(
        ((2, 3, 5, 37), (5, 37)), lambda x, mask: fastlm.masked_softmax(x, mask, scale=0.5),
        lambda x, mask: torch.softmax(0.5 * x + mask, dim=-1), shift_invariant=True),
    "layer_norm": Case(
        ((4, 37), (37,), (37,)), lambda x, w, b: fastlm.layer_norm(x, w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)),
    "rms_norm": Case(
        ((4, 37), (37,)), lambda x, w: fastlm.rms_norm(x, w, 1e-5), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-5)),
    # the offset on v moves the output by the same amount; dq and dk come from dP - rowsum(dO * O),
    # a difference of two dot products of that size in any implementation, so only dv is compared there
    "flash_attention": Case(
        ((1, 2, 20, 16),) * 3, lambda q, k, v: fastlm.flash_attention(q, k, v, causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), offset_input=2,
        gradients_at_offset=(2,), tolerance_factor=2.0),
    "causal_conv1d silu": Case(
        ((2, 13, 8), (8, 4), (8,)), lambda u, w, b: fastlm.causal_conv1d(u, w, b, "silu"), _causal_conv),
    "weighted_sum": Case(((4, 37), (37,)), weighted_sum, lambda x, w: (x * w).sum(-1)),
    "swiglu": Case(((4, 37), (4, 37)), fastlm.swiglu, lambda gate, up: F.silu(gate) * up),
    "geglu tanh": Case(((4, 37), (4, 37)), fastlm.geglu, lambda gate, up: F.gelu(gate, approximate="tanh") * up),
    "geglu exact": Case(
        ((4, 37), (4, 37)), lambda gate, up: fastlm.geglu(gate, up, "none"), lambda gate, up: F.gelu(gate) * up),
    "rms_norm 1 + weight": Case(
        ((4, 37), (37,)), lambda x, w: fastlm.rms_norm(x, w, 1e-6, weight_offset=1.0),
        one_plus_weight_rms_norm),
}  # fmt: skip


def _grid():
    for name, case in CASES.items():
        for dtype, offsets in (SHIFTS if case.shift_invariant else VALUES).items():
            for offset in offsets:
                yield pytest.param(name, dtype, offset, id=f"{name}-{dtype}-{offset:g}")


def _inputs(case, dtype, offset, device):
    """Random inputs in ``dtype``, the offset added to one; a masked_softmax mask of 0 and -inf."""
    inputs = [torch.randn(shape, device=device) for shape in case.shapes]
    inputs[case.offset_input] += offset
    if case is CASES["masked_softmax"]:
        inputs[1] = torch.where(inputs[1] < -0.8, float("-inf"), 0.0)  # about a fifth of the keys
    if case is CASES["causal_conv1d silu"]:
        inputs[1] /= case.shapes[1][1]  # taps summing to about 1: outputs near the offset, not K times it
    compared = range(len(inputs)) if offset == 0 or case.gradients_at_offset is None else case.gradients_at_offset
    return [t.to(dtype).requires_grad_(i in compared) for i, t in enumerate(inputs)]


@pytest.mark.parametrize("name,dtype,offset", _grid())
def test_at_least_as_accurate_as_torch(name, dtype, offset, device):
    case = CASES[name]
    inputs = _inputs(case, DTYPES[dtype], offset, device)
    upstream = torch.tensor(1.0, device=device) if case.unit_upstream else None  # a summed loss
    tolerance = TOLERANCE[dtype] * (case.tolerance_factor if dtype != "fp32" else 1.0)
    check_against_float64(case.fastlm, case.torch, inputs, tolerance, upstream=upstream)
