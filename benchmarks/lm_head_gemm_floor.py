"""The cuBLAS floor of the LM head's three matmuls, for `fastlm bench dpo`'s notes: each GEMM of one
group of C rows alone (bf16, V = 128256, d = 4096), timed as the fused losses run it, and the sum
against a measured fwd+bwd. Usage: python3 benchmarks/lm_head_gemm_floor.py [C ...] (default 2048 8192).
"""

import sys

import torch

from fastlm.harness.timing import measure

V, D = 128256, 4096


def gemms(rows: int, device: torch.device) -> dict:
    """The three matmuls of one group of ``rows`` tokens, as callables over fresh buffers."""
    weight = torch.randn(V, D, device=device, dtype=torch.bfloat16)
    grad_weight = torch.empty_like(weight)
    hidden = torch.randn(rows, D, device=device, dtype=torch.bfloat16)
    logits = torch.empty(rows, V, device=device, dtype=torch.bfloat16)
    return {
        "logits = h @ W.T": lambda: torch.mm(hidden, weight.t(), out=logits),
        "grad_h = G @ W": lambda: torch.mm(logits, weight),
        "grad_W += G.T @ h": lambda: torch.addmm(grad_weight, logits.t(), hidden, out=grad_weight),
    }


def main(rows_list: list[int]) -> None:
    device = torch.device("cuda")
    for rows in rows_list:
        total = 0.0
        for name, fn in gemms(rows, device).items():
            ms = measure(fn, device, warmup_ms=100, rep_ms=500).median_ms
            total += ms
            print(f"C={rows:5d}  {name:18s} {ms:7.3f} ms  {2 * rows * V * D / ms / 1e9:6.0f} TFLOP/s")
        print(f"C={rows:5d}  three GEMMs        {total:7.3f} ms  {6 * rows * V * D / total / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [2048, 8192])
