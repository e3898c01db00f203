"""Tokens into expert order and back: the sort that groups the (token, expert) pairs by expert, and
the weighted sum that brings each token's expert outputs back to it.

    top_k_index (T, K): the experts of token t;  pair p = t K + j;  S = T K pairs
    expert_order -> ExpertOrder: order (S,) (sorted row s holds pair order[s]), tokens (S,) (its
                    token), positions (T, K) (the sorted row of pair (t, j)), offsets (E + 1,)
    combine      out[t] = sum_j weight[t, j] Y[positions[t, j]]        Y (S, D) -> out (T, D)

A pair whose expert is outside [0, E) belongs to no expert (transformers marks the pairs of
experts held by another process that way): the sort puts it before or after every expert's rows,
no expert computes it and `combine` adds nothing for it, on every path. The order comes from a
stable sort and searchsorted, so no value is read back to the host and the result is the same on
every run. `combine` sums a token's K rows in fp32 in the order j = 0..K-1: deterministic, no
atomics; its backward gives dweight[t, j] = dout[t] . Y[positions[t, j]] by the same gather.
Bytes: combine reads S D + 2 S and writes T D elements. Where the kernels do not run (CPU tensors
without the interpreter, fake tensors while torch.compile traces on a CPU) both are PyTorch ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fastlm.ops.common import cdiv, next_power_of_2, runs_triton
from fastlm.ops.launch import launcher


class ExpertOrder(NamedTuple):
    """Where each (token, expert) pair goes (module docstring); int32 but for order."""

    order: torch.Tensor  # (S,) int64: the pair of sorted row s
    tokens: torch.Tensor  # (S,) int32: the token of sorted row s
    positions: torch.Tensor  # (T, K) int32: the sorted row of pair (t, j)
    offsets: torch.Tensor  # (E + 1,) int32: expert e's sorted rows are [offsets[e], offsets[e + 1])


def expert_order(top_k_index: torch.Tensor, num_experts: int) -> ExpertOrder:
    """The `ExpertOrder` of ``top_k_index`` (T, K) over ``num_experts`` experts: a few small launches."""
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, bounds).to(torch.int32)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    tokens = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    return ExpertOrder(order, tokens, positions.view(t, k).to(torch.int32), offsets)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    Y,  # (S, D) rows in expert order, contiguous
    POSITIONS,  # (T, K) int32, contiguous: the sorted row of pair (t, j)
    EXPERTS,  # (T, K) contiguous: the expert of pair (t, j); a pair outside [0, E) adds nothing
    WEIGHTS,  # (T, K) contiguous: the weight of pair (t, j); unread without WEIGHTED
    OUT,  # (T, D) output, contiguous
    T, D, K, E,
    WEIGHTED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (ceil(T / BLOCK_T), ceil(D / BLOCK_D))."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_mask = tokens < T
    col_mask = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in range(K):
        expert = tl.load(EXPERTS + tokens * K + j, mask=token_mask, other=-1)
        valid = token_mask & (expert >= 0) & (expert < E)
        rows = tl.load(POSITIONS + tokens * K + j, mask=valid, other=0).to(tl.int64)
        y = tl.load(Y + rows[:, None] * D + cols[None, :], mask=valid[:, None] & col_mask[None, :], other=0.0)
        if WEIGHTED:
            y = y.to(tl.float32) * tl.load(WEIGHTS + tokens * K + j, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc += y.to(tl.float32)
    tl.store(
        OUT + tokens[:, None] * D + cols[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=token_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _combine_weight_grad_kernel(
    DOUT,  # (T, D) upstream gradient, contiguous
    Y,  # (S, D) rows in expert order, contiguous
    POSITIONS,  # (T, K) int32, contiguous
    EXPERTS,  # (T, K) contiguous
    DWEIGHTS,  # (T, K) fp32 output: dout[t] . Y[positions[t, j]], 0 for a pair of no expert
    T, D, K, E,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (ceil(T / BLOCK_T),): each program walks D once per pair slot j."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < T
    slots = tl.arange(0, BLOCK_K)
    result = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for j in range(K):
        expert = tl.load(EXPERTS + tokens * K + j, mask=token_mask, other=-1)
        valid = token_mask & (expert >= 0) & (expert < E)
        rows = tl.load(POSITIONS + tokens * K + j, mask=valid, other=0).to(tl.int64)
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = valid[:, None] & (cols < D)[None, :]
            dout = tl.load(DOUT + tokens[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            total += tl.sum(dout * y, axis=1)
        result = tl.where(slots[None, :] == j, total[:, None], result)
    mask = token_mask[:, None] & (slots < K)[None, :]
    tl.store(DWEIGHTS + tokens[:, None] * K + slots[None, :], result, mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_BLOCK_T = 16  # tokens per program
_BLOCK_D = 256  # columns per program (combine) and per step (its weight gradient)
_launch_combine = launcher(_combine_kernel)
_launch_combine_weight_grad = launcher(_combine_weight_grad_kernel)


def combine(
    y: torch.Tensor,
    positions: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    weights: torch.Tensor | None = None,
    traced: bool = False,
) -> torch.Tensor:
    """out (T, D) in y's dtype: sum over j of weights[t, j] (1 without ``weights``) times
    y[positions[t, j]], the pairs of no expert left out; y (S, D) contiguous."""
    t, k = positions.shape
    d = y.shape[1]
    if not runs_triton(y):
        terms = _pair_rows(y, positions, top_k_index, num_experts)
        if weights is not None:
            terms = terms * weights[..., None].float()
        return terms.sum(dim=1).to(y.dtype)
    out = torch.empty((t, d), dtype=y.dtype, device=y.device)
    if t and d:
        block_d = min(_BLOCK_D, max(16, next_power_of_2(d)))
        _launch_combine(traced)[(cdiv(t, _BLOCK_T), cdiv(d, block_d))](
            y, positions, top_k_index, positions if weights is None else weights, out, t, d, k, num_experts,
            WEIGHTED=weights is not None, BLOCK_T=_BLOCK_T, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def combine_weight_grad(
    dout: torch.Tensor,
    y: torch.Tensor,
    positions: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    traced: bool = False,
) -> torch.Tensor:
    """dweights (T, K) fp32 of `combine`: dout (T, D) and y (S, D), both contiguous."""
    t, k = positions.shape
    if not runs_triton(y):
        return (_pair_rows(y, positions, top_k_index, num_experts) * dout[:, None, :].float()).sum(dim=-1)
    dweights = torch.empty((t, k), dtype=torch.float32, device=y.device)
    if t:
        block_d = min(_BLOCK_D, max(16, next_power_of_2(y.shape[1])))
        _launch_combine_weight_grad(traced)[(cdiv(t, _BLOCK_T),)](
            dout, y, positions, top_k_index, dweights, t, y.shape[1], k, num_experts,
            BLOCK_T=_BLOCK_T, BLOCK_D=block_d, BLOCK_K=max(2, next_power_of_2(k)),
        )  # fmt: skip
    return dweights


def _pair_rows(y: torch.Tensor, positions: torch.Tensor, top_k_index: torch.Tensor, num_experts: int):
    """(T, K, D) fp32 (float64 stays): y's row of each pair, 0 for a pair of no expert."""
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    rows = y[positions.long()].to(torch.promote_types(y.dtype, torch.float32))
    return torch.where(valid[..., None], rows, 0.0)
