"""Sweep tile sizes and warps of the cross-entropy kernels on the GPU (B=4096, bf16).

Prints one JSON line per (kernel, vocab, BLOCK_V, num_warps) with the median ms and GB/s of the
kernel's cost-model bytes; the launchers' heuristics in fastlm/ops/cross_entropy.py are set from
these runs. Usage: python benchmarks/tune_xent.py > tune.jsonl
"""

import json
import sys

import torch
import triton
import triton.testing

from fastlm.ops import cross_entropy as ce

BATCH = 4096
VOCABS = (32000, 50264, 128256)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def main():
    for vocab in VOCABS:
        logits = torch.randn(BATCH, vocab, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (BATCH,), device="cuda")
        losses = torch.empty(BATCH, device="cuda")
        lse = torch.empty(BATCH, device="cuda")
        grad = torch.empty_like(logits)
        ones = torch.ones(BATCH, device="cuda")
        row_bytes = 2 * BATCH * vocab
        for block in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                common = dict(BLOCK_V=block, HAS_SMOOTHING=False, HAS_Z_LOSS=False, num_warps=warps)
                runs = {
                    "forward": (
                        lambda: ce._cross_entropy_forward_kernel[(BATCH,)](
                            logits, vocab, 1, targets, 1, losses, lse, vocab, -100, 0.0, 0.0, **common
                        ),
                        row_bytes,
                    ),
                    "backward": (
                        lambda: ce._cross_entropy_backward_kernel[(BATCH, triton.cdiv(vocab, block))](
                            logits, vocab, 1, targets, 1, lse, ones, 1, grad, vocab, -100, 0.0, 0.0, **common
                        ),
                        2 * row_bytes,
                    ),
                    "fused": (
                        lambda: ce._cross_entropy_fused_kernel[(BATCH,)](
                            logits, vocab, 1, targets, 1, None, 0, losses, grad, vocab, 1,
                            vocab, -100, 0.0, 0.0, HAS_ROW_SCALE=False, **common,
                        ),
                        2 * row_bytes,
                    ),
                }
                for name, (fn, nbytes) in runs.items():
                    try:
                        ms = bench(fn)
                    except Exception as error:  # a config that does not compile (registers, shared memory)
                        print(json.dumps({"kernel": name, "vocab": vocab, "block": block, "warps": warps,
                                          "error": str(error)[:200]}))
                        continue
                    print(json.dumps({"kernel": name, "vocab": vocab, "block": block, "warps": warps,
                                      "ms": ms, "gbps": nbytes / ms / 1e6}))
                    sys.stdout.flush()
        del logits, grad


if __name__ == "__main__":
    main()
