"""The cases of `fastlm bench host`: each op at a small shape where the GPU takes a few microseconds
and the host dominates, called exactly as a user calls it, next to the plain-PyTorch code it
replaces. Their float inputs require grad."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastlm
from fastlm.ops.rotary import rotate_half
from fastlm.ops.weighted_sum import weighted_sum

SOFTMAX_SCALE = 0.125  # 1 / sqrt(64): attention scores of head dim 64
CONV_TAPS = 4  # K of the causal conv1d (Mamba's)


@dataclass(frozen=True)
class HostCase:
    op: str  # fastlm's name for it
    shape: tuple[int, ...]  # the main input's shape
    baseline: str  # the PyTorch code fastlm replaces, as the report shows it
    inputs: Callable[[tuple[int, ...], torch.device, torch.dtype], tuple]  # (shape, device, dtype) -> args
    pytorch: Callable[..., torch.Tensor]  # both take the same args
    fastlm: Callable[..., torch.Tensor]


def _leaf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)


def _logits_targets(shape, device, dtype):
    return _leaf(shape, device, dtype), torch.randint(0, shape[1], shape[:1], device=device)


def _qkv(shape, device, dtype):
    return tuple(_leaf(shape, device, dtype) for _ in range(3))


def _x_weight(shape, device, dtype):
    return _leaf(shape, device, dtype), _leaf(shape[-1:], device, dtype)


def _x_weight_bias(shape, device, dtype):
    return (*_x_weight(shape, device, dtype), _leaf(shape[-1:], device, dtype))


def _scores_causal_mask(shape, device, dtype):
    """Scores (B, H, Sq, Sk) and the additive causal mask (Sq, Sk) that PyTorch code adds to them."""
    sq, sk = shape[-2:]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
    mask = torch.zeros(sq, sk, device=device, dtype=dtype).masked_fill(~visible, float("-inf"))
    return _leaf(shape, device, dtype), mask


def _rotary_inputs(shape, device, dtype):
    """q and k (B, H, N, D) as heads of a (B, N, H, D) projection, and fp32 cos, sin tables (N, D/2)."""
    b, h, n, d = shape
    q, k = (torch.randn(b, n, h, d, device=device, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(2))
    angles = torch.arange(n, device=device)[:, None] * torch.rand(d // 2, device=device)
    return q, k, angles.cos(), angles.sin()


def _conv_inputs(shape, device, dtype):
    """u (B, L, D) channels-last, weight (D, K), bias (D,)."""
    return _leaf(shape, device, dtype), _leaf((shape[-1], CONV_TAPS), device, dtype), _leaf(shape[-1:], device, dtype)


# One module-level function per implementation: torch.compile caches compiled code per function.
def _pytorch_cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets)


def _fastlm_cross_entropy(logits, targets):
    return fastlm.cross_entropy(logits, targets)


def _pytorch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fastlm_attention(q, k, v):
    return fastlm.flash_attention(q, k, v, causal=True)


def _pytorch_rms_norm(x, weight):
    return F.rms_norm(x, x.shape[-1:], weight, eps=1e-5)


def _fastlm_rms_norm(x, weight):
    return fastlm.rms_norm(x, weight, eps=1e-5)


def _pytorch_layer_norm(x, weight, bias):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps=1e-5)


def _fastlm_layer_norm(x, weight, bias):
    return fastlm.layer_norm(x, weight, bias, eps=1e-5)


def _pytorch_masked_softmax(x, mask):
    return torch.softmax(x * SOFTMAX_SCALE + mask, dim=-1)


def _fastlm_masked_softmax(x, mask):  # the implicit causal mask: fastlm needs no mask tensor
    return fastlm.masked_softmax(x, scale=SOFTMAX_SCALE, causal=True)


def _pytorch_rotary(q, k, cos, sin):  # one output for the backward: the sum costs both sides one op
    return rotate_half(q, cos, sin) + rotate_half(k, cos, sin)  # the model's RoPE in PyTorch ops


def _fastlm_rotary(q, k, cos, sin):
    q_out, k_out = fastlm.rotary_embedding(q, k, cos, sin)
    return q_out + k_out


def _pytorch_causal_conv1d(u, weight, bias):
    length, taps = u.shape[1], weight.shape[1]
    z = F.conv1d(u.transpose(1, 2), weight.unsqueeze(1), bias, padding=taps - 1, groups=u.shape[2])  # (B, D, L+K-1)
    return F.silu(z[..., :length]).transpose(1, 2)  # (B, L, D)


def _fastlm_causal_conv1d(u, weight, bias):
    return fastlm.causal_conv1d(u, weight, bias, activation="silu")


def _pytorch_weighted_sum(x, weight):
    return (x * weight).sum(-1)


def _fastlm_weighted_sum(x, weight):
    return weighted_sum(x, weight)


CASES = {
    case.op: case
    for case in (
        HostCase(
            "cross_entropy",
            (8, 32000),
            "F.cross_entropy(logits, targets)",
            _logits_targets,
            _pytorch_cross_entropy,
            _fastlm_cross_entropy,
        ),
        HostCase(
            "flash_attention",
            (1, 8, 128, 64),
            "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
            _qkv,
            _pytorch_attention,
            _fastlm_attention,
        ),
        HostCase("rms_norm", (64, 1024), "F.rms_norm(x, (D,), w)", _x_weight, _pytorch_rms_norm, _fastlm_rms_norm),
        HostCase(
            "layer_norm",
            (64, 1024),
            "F.layer_norm(x, (D,), w, b)",
            _x_weight_bias,
            _pytorch_layer_norm,
            _fastlm_layer_norm,
        ),
        HostCase(
            "masked_softmax",
            (1, 8, 128, 128),
            f"torch.softmax(x * {SOFTMAX_SCALE} + causal_mask, -1)",
            _scores_causal_mask,
            _pytorch_masked_softmax,
            _fastlm_masked_softmax,
        ),
        HostCase(
            "causal_conv1d",
            (1, 128, 256),
            f"silu(F.conv1d(u^T, w, b, padding={CONV_TAPS - 1}, groups=D)[..., :L])^T",
            _conv_inputs,
            _pytorch_causal_conv1d,
            _fastlm_causal_conv1d,
        ),
        HostCase("weighted_sum", (64, 1024), "(x * w).sum(-1)", _x_weight, _pytorch_weighted_sum, _fastlm_weighted_sum),
        HostCase(
            "rotary_embedding",
            (1, 8, 128, 64),
            "rotate-half RoPE of q and k in PyTorch ops, summed",
            _rotary_inputs,
            _pytorch_rotary,
            _fastlm_rotary,
        ),
    )
}
