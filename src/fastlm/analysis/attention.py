"""Napkin math for attention: FLOPs of the conventional count and bytes of materialized scores.

FLOP convention (as FlashAttention's papers and benchmarks count it):
    forward   4 * B * H * Nq * Nk * D      (Q K^T and P V, 2 FLOPs per multiply-add)
              halved under a causal mask with Nq == Nk (only the lower triangle is needed)
    backward  2.5 x forward                (five matmuls of the same size as the forward's two)
Softmax exponentials and the mask are not counted. An implementation that recomputes more (as
fastlm's deterministic backward does, 7 matmuls instead of 5) still gets the conventional count,
so TFLOP/s compare like speeds.
"""

from __future__ import annotations

BACKWARD_FLOPS_RATIO = 2.5


def attention_forward_flops(batch: int, heads: int, nq: int, nk: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * nq * nk * head_dim
    return flops / 2 if causal else flops


def scores_bytes(batch: int, heads: int, nq: int, nk: int, element_size: int) -> int:
    """Bytes of one materialized (B, H, Nq, Nk) score-sized tensor (scores, probabilities, grads)."""
    return batch * heads * nq * nk * element_size


SOFTMAX_FLOPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide


def naive_attention_stage_flops(batch: int, heads: int, n: int, head_dim: int) -> dict[str, float]:
    """FLOPs of each stage of materialized causal attention over (B, H, N, D) q/k/v: the full N x N
    scores are computed (the mask only overwrites the upper triangle afterwards)."""
    elements = batch * heads * n * n
    return {
        "scores": 2.0 * elements * head_dim,  # q k^T, then the 1/sqrt(D) scale (not counted)
        "mask": float(elements),  # one select per score
        "softmax": float(SOFTMAX_FLOPS_PER_ELEMENT * elements),
        "output": 2.0 * elements * head_dim,  # P v
    }
