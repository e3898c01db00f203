"""Edge shapes (0-sized dims, length 1) through both paths of every op: the Triton kernels (CUDA,
or the interpreter on CPU) and the plain-PyTorch path (CPU without TRITON_INTERPRET). Each path
must give the float64 reference's output and every gradient, so the two agree with each other."""

import pytest
import torch
import torch.nn.functional as F

import fastlm
from fastlm.ops.causal_conv1d import causal_conv1d_ref
from fastlm.ops.cross_entropy import cross_entropy_ref
from fastlm.ops.flash_attention import flash_attention_ref
from fastlm.ops.masked_softmax import masked_softmax_ref
from fastlm.ops.swiglu import geglu_ref, swiglu_ref
from fastlm.ops.weighted_sum import weighted_sum, weighted_sum_ref

from .reference import check_against_float64

ALLOWANCE = 1e-6  # fp32 (how far fastlm's normwise error may pass the reference's: sums in other orders)


def xent(batch, vocab, ignored=False, fused=True, **options):
    """Cross-entropy over (batch, vocab) logits; targets fixed here (the checker takes float inputs only)."""
    targets = torch.full((batch,), -100) if ignored else torch.randint(0, vocab, (batch,))
    return (
        lambda logits: fastlm.cross_entropy(logits, targets.to(logits.device), fused=fused, **options),
        lambda logits: cross_entropy_ref(logits, targets.to(logits.device), **options),
        [(batch, vocab)],
    )


def attention(q_shape, kv_shape, causal=False):
    return (
        lambda q, k, v: fastlm.flash_attention(q, k, v, causal=causal),
        lambda q, k, v: flash_attention_ref(q, k, v, causal=causal),
        [q_shape, kv_shape, kv_shape],
    )


def norm(kind, shape, affine=True, eps=1e-5):
    """PyTorch's own norms as the reference: they keep float64 in float64 (the `*_norm_ref` do not)."""
    params = [(shape[-1],)] * (2 if kind == "layer" else 1)
    if kind == "layer":
        return (
            lambda x, w=None, b=None: fastlm.layer_norm(x, w, b, eps),
            lambda x, w=None, b=None: F.layer_norm(x, x.shape[-1:], w, b, eps),
            [shape, *(params if affine else [])],
        )
    return (lambda x, w: fastlm.rms_norm(x, w, eps), lambda x, w: F.rms_norm(x, x.shape[-1:], w, eps), [shape, *params])


def softmax(shape, mask_shape=None, causal=False):
    return (
        lambda x, mask=None: fastlm.masked_softmax(x, mask, scale=0.5, causal=causal),
        lambda x, mask=None: masked_softmax_ref(x, mask, scale=0.5, causal=causal),
        [shape] + ([mask_shape] if mask_shape else []),
    )


def conv(batch, length, d, k, activation=None):
    return (
        lambda u, w, b: fastlm.causal_conv1d(u, w, b, activation),
        lambda u, w, b: causal_conv1d_ref(u, w, b, activation),
        [(batch, length, d), (d, k), (d,)],
    )


EDGES = {
    "xent B=0, sum": xent(0, 5, reduction="sum"),
    "xent B=0, none": xent(0, 5, reduction="none"),
    "xent B=1, V=1": xent(1, 1),
    "xent V=1, recompute": xent(3, 1, fused=False),
    "xent all rows ignored, sum": xent(3, 7, ignored=True, reduction="sum"),
    "attention Z=0": attention((0, 2, 3, 16), (0, 1, 3, 16)),
    "attention H=0, Hkv=0": attention((1, 0, 3, 16), (1, 0, 3, 16)),
    "attention H=0, Hkv=1": attention((1, 0, 3, 16), (1, 1, 3, 16)),
    "attention Nq=0": attention((1, 2, 0, 16), (1, 1, 3, 16)),
    "attention Nk=0": attention((1, 2, 3, 16), (1, 1, 0, 16)),
    "attention Nk=0, causal": attention((1, 2, 3, 16), (1, 1, 0, 16), causal=True),
    "attention Nq=Nk=1, D=1, causal": attention((1, 1, 1, 1), (1, 1, 1, 1), causal=True),
    "attention Nq=1, Nk=5, causal": attention((2, 1, 8), (2, 5, 8), causal=True),
    "attention Nq=5, Nk=1, causal": attention((2, 5, 8), (2, 1, 8), causal=True),  # 4 rows see no key
    "layer_norm D=0": norm("layer", (3, 0)),
    "layer_norm M=0": norm("layer", (0, 4)),
    "layer_norm D=1": norm("layer", (3, 1)),
    "layer_norm 1-D, no affine": norm("layer", (5,), affine=False),
    "rms_norm D=0": norm("rms", (3, 0)),
    # over one element x / sqrt(x^2 + eps) is sign(x) up to eps: with a small eps, dx (~eps / |x|^3)
    # would be what is left of unit-sized terms cancelling, a few digits in any formula
    "rms_norm D=1": norm("rms", (3, 1), eps=1.0),
    "rms_norm (1, 1)": norm("rms", (1, 1), eps=1.0),
    "softmax Sk=0": softmax((2, 3, 0)),
    "softmax Sq=0, causal": softmax((2, 0, 3), causal=True),
    "softmax Sk=1, mask": softmax((2, 3, 1), (3, 1)),
    "softmax (1,)": softmax((1,)),
    "softmax (1, 1), causal": softmax((1, 1), causal=True),
    "softmax Sq=1, broadcast mask": softmax((2, 1, 4), (1, 1, 4)),
    "conv L=0": conv(2, 0, 3, 2),
    "conv D=0": conv(2, 4, 0, 2),
    "conv B=0": conv(0, 4, 3, 2),
    "conv L=1, K=4, silu": conv(1, 1, 3, 4, "silu"),
    "conv D=1, K=1": conv(2, 3, 1, 1),
    "weighted_sum D=0": (weighted_sum, weighted_sum_ref, [(3, 0), (0,)]),
    "weighted_sum R=0": (weighted_sum, weighted_sum_ref, [(0, 3), (3,)]),
    "weighted_sum 1-D": (weighted_sum, weighted_sum_ref, [(3,), (3,)]),
    "weighted_sum (1, 1)": (weighted_sum, weighted_sum_ref, [(1, 1), (1,)]),
    "swiglu R=0": (fastlm.swiglu, swiglu_ref, [(0, 3), (0, 3)]),
    "swiglu D=0": (fastlm.swiglu, swiglu_ref, [(3, 0), (3, 0)]),
    "swiglu (1,)": (fastlm.swiglu, swiglu_ref, [(1,), (1,)]),
    "geglu R=0": (fastlm.geglu, geglu_ref, [(0, 3), (0, 3)]),
    "geglu (1,), exact": (lambda g, u: fastlm.geglu(g, u, "none"), lambda g, u: geglu_ref(g, u, "none"), [(1,), (1,)]),
}


@pytest.mark.parametrize("path", ["kernels", "reference"])
@pytest.mark.parametrize("case", EDGES)
def test_edge_shape_on_both_paths(case, path, device, monkeypatch):
    if path == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        device = torch.device("cpu")
    function, reference, shapes = EDGES[case]
    inputs = [torch.randn(shape, device=device, requires_grad=True) for shape in shapes]
    out = check_against_float64(function, reference, inputs, ALLOWANCE)
    assert out.device.type == device.type
