"""The experts of a mixture of experts, forward and backward: gated MLPs over each expert's tokens.

    x (T, D) tokens, top_k_index (T, K) their experts, top_k_weights (T, K) the routing weights
    gate_up (E, 2I, D): expert e's gate rows [0, I) and up rows [I, 2I) (transformers' gate_up_proj)
    down (E, D, I)
    out[t] = sum_j w[t, j] down[e] (act(gate[e] x_t) * up[e] x_t),  e = top_k_index[t, j]

Forward, S = T K sorted pairs (`permute.expert_order`), four launches past the sort:
    GU, H = grouped_matmul(x[tokens], gate_up, "glu")     (S, 2I), (S, I): the gather and the gating fused
    Y = grouped_matmul(H, down)                           (S, D)
    out = combine(Y, weights)                             (T, D)
Backward, six launches past one gather of the weights in expert order (w_s):
    dGU = gating'(w_s dout[tokens] @ down)    grouped_matmul "glu_backward": the scale and gating fused
    d down = sum_s (w_s dout[token_s])^T H_s  grouped_weight_grad, the gather and the scale fused
    dX_s = dGU @ gate_up;  dx = combine(dX)   the K rows of each token summed in order
    d gate_up = sum_s dGU_s^T x[token_s]      grouped_weight_grad, the gather fused
    d weights[t, j] = dout[t] . Y[positions[t, j]]
The forward keeps GU, H and Y for the backward, (4I + D) S elements, what transformers' eager
loop keeps too. FLOPs: 6 S D I forward, 12 S D I backward; no atomics anywhere, so the gradients
are the same on every run. A pair whose expert is outside [0, E) adds nothing (`permute`).
On a CPU without the interpreter an eager call runs `moe_experts_ref`, transformers' loop over the
experts; while torch.compile traces, the op runs the primitives' PyTorch paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastlm.ops.common import DTYPES, check_dtype, check_same_device, check_tensor, is_traced, runs_triton
from fastlm.ops.moe.grouped_matmul import grouped_matmul, grouped_weight_grad
from fastlm.ops.moe.permute import ExpertOrder, combine, combine_weight_grad, expert_order

# the gatings fused, as `fastlm.layers.mlp.GATED_ACTIVATIONS` names them
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_INDEX_DTYPES = (torch.int64, torch.int32)

# ----------------------------------------------------------------------------------------------
# Launchers: one per direction, shared by the eager autograd.Function and the triton_ops
# ----------------------------------------------------------------------------------------------


def _forward(x, gate_up, down, top_k_index, top_k_weights, activation: str, traced: bool = False):
    """(out, GU, H, Y, the ExpertOrder's four tensors)."""
    experts = gate_up.shape[0]
    plan = expert_order(top_k_index, experts)
    h, gu = grouped_matmul(
        x, gate_up, plan.offsets, rows=plan.tokens, epilogue="glu", activation=activation, traced=traced
    )
    y = grouped_matmul(h, down, plan.offsets, traced=traced)
    out = combine(y, plan.positions, top_k_index, experts, top_k_weights, traced=traced)
    return (out, gu, h, y, *plan)


def _backward(
    dout,
    x,
    gate_up,
    down,
    top_k_index,
    top_k_weights,
    gu,
    h,
    y,
    plan: ExpertOrder,
    activation: str,
    traced: bool = False,
):
    """(dx, d gate_up, d down, d top_k_weights)."""
    experts = gate_up.shape[0]
    dout = dout.contiguous()
    row_weights = top_k_weights.reshape(-1)[plan.order].float()  # (S,): w_s of sorted row s
    dgu = grouped_matmul(
        dout, down.transpose(1, 2), plan.offsets, rows=plan.tokens, scale=row_weights,
        epilogue="glu_backward", gu=gu, activation=activation, traced=traced,
    )  # fmt: skip
    d_down = grouped_weight_grad(
        dout, h, plan.offsets, experts, g_rows=plan.tokens, scale=row_weights, dtype=down.dtype, traced=traced
    )
    dx_rows = grouped_matmul(dgu, gate_up.transpose(1, 2), plan.offsets, traced=traced)  # (S, D)
    dx = combine(dx_rows, plan.positions, top_k_index, experts, traced=traced)
    d_gate_up = grouped_weight_grad(
        dgu, x, plan.offsets, experts, x_rows=plan.tokens, dtype=gate_up.dtype, traced=traced
    )
    d_weights = combine_weight_grad(dout, y, plan.positions, top_k_index, experts, traced=traced)
    return dx, d_gate_up, d_down, d_weights.to(top_k_weights.dtype)


# ----------------------------------------------------------------------------------------------
# torch.library ops (torch.compile) and their autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::moe_experts_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:  # out, GU, H, Y, order, tokens, positions, offsets
    return _forward(x, gate_up, down, top_k_index, top_k_weights, activation, traced=True)


@torch.library.triton_op("fastlm::moe_experts_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gu: torch.Tensor,
    h: torch.Tensor,
    y: torch.Tensor,
    order: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = ExpertOrder(order, tokens, positions, offsets)
    return _backward(dout, x, gate_up, down, top_k_index, top_k_weights, gu, h, y, plan, activation, traced=True)


def _setup_context(ctx, inputs, output):
    x, gate_up, down, top_k_index, top_k_weights, activation = inputs
    ctx.save_for_backward(x, gate_up, down, top_k_index, top_k_weights, *output[1:])
    ctx.activation = activation


def _op_backward(ctx, dout, *unused):
    saved = ctx.saved_tensors
    dx, d_gate_up, d_down, d_weights = _backward_op(dout, *saved, ctx.activation)
    return dx, d_gate_up, d_down, None, d_weights, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_setup_context)


class MoEExpertsFunction(torch.autograd.Function):
    """Eager path: ``MoEExpertsFunction.apply(x, gate_up, down, top_k_index, top_k_weights,
    activation)``, the inputs checked by `moe_experts`."""

    @staticmethod
    def forward(ctx, x, gate_up, down, top_k_index, top_k_weights, activation):
        out, *saved = _forward(x, gate_up, down, top_k_index, top_k_weights, activation)
        ctx.save_for_backward(x, gate_up, down, top_k_index, top_k_weights, *saved)
        ctx.activation = activation
        return out

    @staticmethod
    def backward(ctx, dout):
        x, gate_up, down, top_k_index, top_k_weights, gu, h, y, *plan = ctx.saved_tensors
        dx, d_gate_up, d_down, d_weights = _backward(
            dout, x, gate_up, down, top_k_index, top_k_weights, gu, h, y, ExpertOrder(*plan), ctx.activation
        )
        return dx, d_gate_up, d_down, None, d_weights, None


# ----------------------------------------------------------------------------------------------
# Public API and reference
# ----------------------------------------------------------------------------------------------


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The experts' output (T, D) in x's dtype (module docstring): x (T, D); gate_up (E, 2I, D) and
    down (E, D, I) in x's dtype; top_k_index (T, K) int64 or int32; top_k_weights (T, K) floating
    point; ``activation`` one of `ACTIVATIONS`. Differentiable in x, both weights and the routing
    weights; a pair whose expert is outside [0, E) adds nothing."""
    for name, value in (("x", x), ("gate_up", gate_up), ("down", down), ("top_k_index", top_k_index)):
        check_tensor(name, value)
    check_tensor("top_k_weights", top_k_weights)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"expected x (T, D), gate_up (E, 2I, D) and down (E, D, I), got shapes {tuple(x.shape)}, "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    experts, two_i, d = gate_up.shape
    if d != x.shape[1] or two_i % 2 or down.shape != (experts, d, two_i // 2):
        raise ValueError(
            f"gate_up must be (E, 2I, {x.shape[1]}) and down (E, {x.shape[1]}, I) for x {tuple(x.shape)}, "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both be (T, K) with T = {x.shape[0]}, got "
            f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    check_dtype("x", x, DTYPES)
    check_dtype("top_k_index", top_k_index, _INDEX_DTYPES)
    check_dtype("top_k_weights", top_k_weights, DTYPES)
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(f"gate_up and down must have x's dtype {x.dtype}, got {gate_up.dtype} and {down.dtype}")
    check_same_device(x=x, gate_up=gate_up, down=down, top_k_index=top_k_index, top_k_weights=top_k_weights)
    if not runs_triton(x) and not is_traced(x):  # eager on a CPU: the loop over experts
        return moe_experts_ref(x, gate_up, down, top_k_index, top_k_weights, activation)
    x, top_k_index, top_k_weights = x.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous()
    if torch.compiler.is_compiling():
        return _forward_op(x, gate_up, down, top_k_index, top_k_weights, activation)[0]
    return MoEExpertsFunction.apply(x, gate_up, down, top_k_index, top_k_weights, activation)


def gating(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up in PyTorch, ``activation`` one of `ACTIVATIONS`."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """`moe_experts` as transformers' eager experts compute it: a loop over the experts in x's
    dtype, each expert's weighted output added to the tokens' sum in that dtype."""
    out = torch.zeros_like(x)
    weights = top_k_weights.to(x.dtype)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(gating(gate, up, activation), down[expert])
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out
