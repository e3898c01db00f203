"""Rotary embedding: outputs and gradients against the reference in every dtype, grouped heads,
strided inputs, the head loop, the gradient's layout, compile, errors."""

import dataclasses

import pytest
import torch

from fastlm.ops import rotary
from fastlm.ops.rotary import RotaryFunction, rotary_config, rotary_embedding, rotary_embedding_ref

from .launches import compiled_code_launches
from .reference import check_against_float64, unit_roundoff


def _tables(length: int, head_dim: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.randn(length, head_dim // 2, device=device) * 3
    return angles.cos(), angles.sin()


def _heads(batch: int, heads: int, length: int, head_dim: int, dtype, device: str = "cpu") -> torch.Tensor:
    """(B, H, N, D) as the model makes it: a transposed view of a (B, N, H, D) projection output."""
    base = torch.randn(batch, length, heads, head_dim, dtype=dtype, device=device)
    return base.transpose(1, 2).requires_grad_()


def _flat(function):
    """One output of both rotated tensors, for the single-output float64 check."""
    return lambda q, k, cos, sin: torch.cat([t.flatten() for t in function(q, k, cos, sin)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 8), (1, 3, 3, 7, 6), (2, 1, 1, 3, 2)])  # B, H, Hkv, N, D
def test_matches_reference_with_gradients(dtype, shape):
    batch, heads, kv_heads, length, head_dim = shape
    q, k = _heads(batch, heads, length, head_dim, dtype), _heads(batch, kv_heads, length, head_dim, dtype)
    cos, sin = _tables(length + 3, head_dim)  # longer tables than the sequence: rows 0..N-1 are used
    allowance = 1e-6 if dtype == torch.float32 else unit_roundoff(dtype) / 4
    check_against_float64(_flat(rotary_embedding), _flat(rotary_embedding_ref), (q, k, cos, sin), allowance)


def test_outputs_are_contiguous_and_gradients_keep_the_inputs_layout():
    q, k = _heads(2, 4, 6, 8, torch.float32), _heads(2, 2, 6, 8, torch.float32)
    cos, sin = _tables(6, 8)
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    dq, dk = torch.autograd.grad((q_out.sum(), k_out.sum()), (q, k))
    assert dq.stride() == q.stride() and dk.stride() == k.stride()  # the views' backward copies nothing
    sliced = torch.randn(2, 4, 6, 16)[..., :8].requires_grad_()  # not dense: a contiguous gradient
    (ds,) = torch.autograd.grad(rotary_embedding(sliced, sliced, cos, sin)[0].sum(), sliced)
    assert ds.is_contiguous()


def test_rotation_by_the_angle_and_back():
    q, k = _heads(1, 2, 4, 4, torch.float64).detach(), _heads(1, 1, 4, 4, torch.float64).detach()
    cos, sin = _tables(4, 4)
    # cos(a)^2 + sin(a)^2 = 1: a rotation keeps each pair's length; the backward rotates back
    q_out, _ = rotary_embedding(q.float(), k.float(), cos, sin)
    pairs = torch.stack(q.float().chunk(2, dim=-1)).norm(dim=0)
    torch.testing.assert_close(torch.stack(q_out.chunk(2, dim=-1)).norm(dim=0), pairs)
    back = rotary._rotate(q_out, q_out, cos, sin, torch.empty_like(q_out), torch.empty_like(q_out), True)[0]
    torch.testing.assert_close(back, q.float())


def test_double_backward_is_an_error_not_a_wrong_gradient():
    q, k = _heads(1, 2, 3, 4, torch.float32), _heads(1, 1, 3, 4, torch.float32)
    cos, sin = _tables(3, 4)
    (dq,) = torch.autograd.grad(rotary_embedding(q, k, cos, sin)[0].square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.square().sum().backward()


def test_explicit_config_loops_over_heads():
    # one head per step (tile of 4 elements, half-width 4): the loop over 5 query and 3 key heads
    config = dataclasses.replace(rotary.DEFAULT_CONFIG, tile_elements=4)
    assert config.block_h(5, 4) == 1
    q, k = _heads(2, 5, 3, 8, torch.float32), _heads(2, 3, 3, 8, torch.float32)
    cos, sin = _tables(3, 8)
    check_against_float64(
        _flat(lambda *a: RotaryFunction.apply(*a, config)), _flat(rotary_embedding_ref), (q, k, cos, sin), 1e-6
    )


def test_config_for_every_architecture():
    for arch in (0, 75, 80, 90, 100, 120):
        config = rotary_config(arch)
        assert config.block_h(25, 32) >= 1 and config.num_warps >= 1
    assert rotary_config(75) == rotary.DEFAULT_CONFIG
    assert [rotary.DEFAULT_CONFIG.block_h(h, 32) for h in (1, 5, 25, 64, 200)] == [1, 8, 32, 64, 64]


def test_compiles_without_graph_breaks():
    q, k = _heads(2, 4, 5, 8, torch.float32), _heads(2, 2, 5, 8, torch.float32)
    cos, sin = _tables(5, 8)

    def loss(function, q, k):
        q_out, k_out = function(q, k, cos, sin)
        return q_out.square().sum() + (k_out * 2).sum()

    compiled = torch.compile(lambda q, k: loss(rotary_embedding, q, k), fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k), (q, k))
    want = torch.autograd.grad(loss(rotary_embedding_ref, q, k), (q, k))
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e)


def test_ops_pass_opcheck():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _tables(7, 8)
    torch.library.opcheck(rotary._forward_op, (q, k, cos, sin))
    torch.library.opcheck(rotary._backward_op, (q, k, cos, sin))


def test_empty_inputs():
    q, k = torch.randn(0, 2, 3, 4, requires_grad=True), torch.randn(0, 1, 3, 4, requires_grad=True)
    cos, sin = _tables(3, 4)
    q_out, k_out = rotary_embedding(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    dq, dk = torch.autograd.grad((q_out.sum(), k_out.sum()), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape


BAD = [
    (lambda q, k, c, s: (q[0], k[0], c, s), ValueError, "must be (B, H, N, D)"),
    (lambda q, k, c, s: (q, k[:, :, :2], c, s), ValueError, "k must match q"),
    (lambda q, k, c, s: (q[..., :3], k[..., :3], c, s), ValueError, "head dim must be even"),
    (lambda q, k, c, s: (q, k, c[:2], s[:2]), ValueError, "cos and sin must be (L, D/2)"),
    (lambda q, k, c, s: (q, k.double(), c, s), TypeError, "q and k must share a dtype"),
    (lambda q, k, c, s: (q, k, c.double(), s), TypeError, "cos must be an fp32 table"),
    (lambda q, k, c, s: (q, k, c, s.requires_grad_()), ValueError, "sin must not require grad"),
    (lambda q, k, c, s: (q.long(), k.long(), c, s), TypeError, "q must have dtype in"),
]


@pytest.mark.parametrize("bend, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_inputs_are_clear_errors(bend, error, message):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = _tables(5, 8)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        rotary_embedding(*bend(q, k, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference_at_the_model_shape(dtype):
    q, k = _heads(4, 25, 512, 64, dtype, "cuda"), _heads(4, 25, 512, 64, dtype, "cuda")
    cos, sin = _tables(1024, 64, "cuda")
    allowance = 1e-6 if dtype == torch.float32 else unit_roundoff(dtype) / 4
    check_against_float64(_flat(rotary_embedding), _flat(rotary_embedding_ref), (q, k, cos, sin), allowance)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernel_from_its_code():
    q, k = _heads(2, 8, 128, 64, torch.bfloat16, "cuda"), _heads(2, 2, 128, 64, torch.bfloat16, "cuda")
    cos, sin = _tables(128, 64, "cuda")

    def rotated(q, k):
        q_out, k_out = rotary_embedding(q, k, cos, sin)
        return q_out.float().sum(-1) + k_out.float().sum((1, -1))[:, None]

    compiled_code_launches(
        rotated, (q, k), kernels=("_rotary_kernel",), ops=("fastlm.rotary_forward", "fastlm.rotary_backward")
    )
