"""Sweep the tiles of the mixture-of-experts grouped matmuls (fastlm.ops.moe.grouped_matmul's
GroupedMatmulConfig) on each of the six launches of one layer's forward and backward.

The layer shapes of `fastlm bench moe` at T tokens with uniform routing, bf16; each configuration
is passed to the launcher (no module state changes). Prints one JSON line per (launch,
configuration) with the median ms (do_bench, L2 flushed) and TFLOP/s, then, on stderr, per
configuration table entry ("glu", "matmul", "glu_backward", "weight_grad") the configuration with the best geometric
mean of TFLOP/s over the launches and shapes that use it, as a GroupedMatmulConfig expression.
Usage: python benchmarks/tune_moe.py [--layers qwen3-30b-a3b,mixtral-8x7b] [--tokens 16384] > tune_moe.jsonl
"""

import argparse
import collections
import functools
import json
import math
import sys

import torch
import triton.testing

from fastlm.bench.moe import LAYERS, Case, routes
from fastlm.ops.moe import expert_order
from fastlm.ops.moe.grouped_matmul import GroupedMatmulConfig, grouped_matmul, grouped_weight_grad

C = GroupedMatmulConfig
MATMUL = [
    C(128, 128, 64, 8, 3),
    C(128, 128, 64, 8, 3, group=1),  # what the swizzle is worth
    C(128, 128, 64, 4, 4),
    C(128, 256, 64, 8, 3),
    C(128, 256, 64, 8, 4),
    C(64, 128, 64, 4, 4),
    C(64, 256, 64, 8, 3),
    C(128, 128, 128, 8, 3),
    C(128, 64, 64, 4, 4),
]
GLU = [
    C(128, 64, 64, 8, 3),
    C(128, 64, 64, 8, 3, group=1),
    C(128, 64, 64, 4, 4),
    C(128, 128, 64, 8, 3),
    C(128, 128, 64, 8, 4),
    C(64, 128, 64, 4, 4),
    C(64, 64, 64, 4, 4),
    C(128, 64, 128, 8, 3),
]
WEIGHT_GRAD = [
    C(64, 128, 128, 8, 3),
    C(64, 128, 128, 8, 3, group=1),
    C(32, 128, 128, 8, 4),
    C(64, 128, 64, 4, 4),
    C(128, 128, 128, 8, 3),
    C(64, 256, 128, 8, 3),
    C(64, 128, 256, 8, 3),
    C(64, 64, 128, 4, 4),
]
CANDIDATES = {"glu": GLU, "matmul": MATMUL, "glu_backward": MATMUL, "weight_grad": WEIGHT_GRAD}


def launches(case: Case):
    """(name, table entry, FLOPs, fn(config)) of the six grouped launches, on inputs made once."""
    layer, device, dtype = case.layer, torch.device("cuda"), torch.bfloat16
    e, d, i, t, k = layer.experts, layer.width, layer.expert_width, case.tokens, layer.top_k
    x = torch.randn(t, d, device=device, dtype=dtype)
    gate_up = torch.randn(e, 2 * i, d, device=device, dtype=dtype) * d**-0.5
    down = torch.randn(e, d, i, device=device, dtype=dtype) * i**-0.5
    index, weights = routes(case, device, torch.Generator().manual_seed(0))
    plan = expert_order(index, e)
    row_weights = weights.detach().reshape(-1)[plan.order].float()
    h, gu = grouped_matmul(x, gate_up, plan.offsets, rows=plan.tokens, epilogue="glu")
    dout = torch.randn_like(x)
    dgu = grouped_matmul(
        dout, down.transpose(1, 2), plan.offsets, rows=plan.tokens, scale=row_weights, epilogue="glu_backward", gu=gu
    )
    s = t * k
    return [
        ("gate_up fwd", "glu", 4 * s * d * i,
         lambda c: grouped_matmul(x, gate_up, plan.offsets, rows=plan.tokens, epilogue="glu", config=c)),
        ("down fwd", "matmul", 2 * s * d * i, lambda c: grouped_matmul(h, down, plan.offsets, config=c)),
        ("dh + gating bwd", "glu_backward", 2 * s * d * i,
         lambda c: grouped_matmul(dout, down.transpose(1, 2), plan.offsets, rows=plan.tokens, scale=row_weights,
                                  epilogue="glu_backward", gu=gu, config=c)),
        ("dx bwd", "matmul", 4 * s * d * i,
         lambda c: grouped_matmul(dgu, gate_up.transpose(1, 2), plan.offsets, config=c)),
        ("d down bwd", "weight_grad", 2 * s * d * i,
         lambda c: grouped_weight_grad(dout, h, plan.offsets, e, g_rows=plan.tokens, scale=row_weights, config=c)),
        ("d gate_up bwd", "weight_grad", 4 * s * d * i,
         lambda c: grouped_weight_grad(dgu, x, plan.offsets, e, x_rows=plan.tokens, config=c)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    rates = collections.defaultdict(list)  # (table entry, config) -> TFLOP/s of each launch it ran
    for name in args.layers.split(","):
        case = Case(LAYERS[name], args.tokens, "uniform")
        for launch, entry, flops, fn in launches(case):
            for config in CANDIDATES[entry]:
                try:
                    ms = triton.testing.do_bench(
                        functools.partial(fn, config), warmup=25, rep=100, return_mode="median"
                    )
                    result = {"ms": ms, "tflops": flops / ms / 1e9}
                    rates[entry, config].append(result["tflops"])
                except Exception as error:  # a configuration that does not compile (shared memory)
                    result = {"error": str(error)[:200]}
                    rates[entry, config].append(0.0)
                print(json.dumps({"layer": name, "tokens": args.tokens, "launch": launch, "entry": entry,
                                  "config": [config.block_m, config.block_n, config.block_k, config.num_warps,
                                             config.num_stages, config.group], **result}), flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    for entry in CANDIDATES:
        scored = [(math.prod(r) ** (1 / len(r)), c) for (e, c), r in rates.items() if e == entry and min(r) > 0]
        best = max(scored, key=lambda pair: pair[0])
        print(f"{entry}: {best[1]!r}  geomean {best[0]:.0f} TFLOP/s", file=sys.stderr)


if __name__ == "__main__":
    main()
