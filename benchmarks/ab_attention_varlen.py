"""A/B of packed attention against one causal sequence of the same tokens, per source tree: run it
once per tree (e.g. with PYTHONPATH pointing at an older checkout's src), interleaved by round.

The documents of `fastlm bench attention --sweep varlen` (two rows of 32k tokens, 16 heads, bf16,
causal in each document) at head dims 64 and 128: the packed kernels with their default tiles, the
same with the forward through pointers (where the default loads it through descriptors), and the
dense kernels on each row as one causal sequence. do_bench, forward alone (no grad) and forward +
backward through autograd; TFLOP/s of the real work (per-document causal for packed, the causal
rows for dense). One record per (head dim, variant).

    python benchmarks/ab_attention_varlen.py OUT.jsonl --tree new --round 0
"""

import argparse
import dataclasses
import json

import torch
import triton

import fastlm
from fastlm.analysis.attention import attention_forward_flops
from fastlm.bench.attention import Documents
from fastlm.ops.common import device_arch
from fastlm.ops.flash_attention import attention_config
from fastlm.ops.flash_attention.api import _FlashAttentionKernels
from fastlm.ops.flash_attention.masks import UNBOUNDED
from fastlm.utils.records import with_environment

ROWS, HEADS, SEQ = 2, 16, 32768


def variants(head_dim: int):
    """name -> (forward on fresh leaf inputs, its inputs, the real work's forward FLOPs)."""
    docs = Documents(ROWS, HEADS, SEQ, head_dim, torch.bfloat16)
    lengths = docs.lengths()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    packed = [
        torch.randn(ROWS * SEQ, HEADS, head_dim, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)
    ]
    default = attention_config(device_arch(torch.device("cuda")), torch.bfloat16, head_dim, longest)
    pointers = dataclasses.replace(default, forward_descriptors=False)

    def varlen(config):
        return lambda q, k, v: _FlashAttentionKernels.apply(
            q, k, v, True, head_dim**-0.5, config, UNBOUNDED, cu, cu, longest
        )

    dense = [
        torch.randn(ROWS, SEQ, HEADS, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        for _ in range(3)
    ]
    one_sequence = attention_forward_flops(ROWS, HEADS, SEQ, SEQ, head_dim, True)
    found = {
        "varlen": (varlen(default), packed, docs.masked_flops),
        "one-sequence": (lambda q, k, v: fastlm.flash_attention(q, k, v, causal=True), dense, one_sequence),
    }
    if default.forward_descriptors:
        found["varlen-pointers"] = (varlen(pointers), packed, docs.masked_flops)
    return found, len(lengths), longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSONL file the records are appended to")
    parser.add_argument("--tree", required=True, help="name of the source tree measured")
    parser.add_argument("--round", type=int, required=True)
    args = parser.parse_args()
    with open(args.out, "a") as out:
        for head_dim in (64, 128):
            found, documents, longest = variants(head_dim)
            for name, (attend, inputs, flops) in found.items():
                grad_out = torch.randn_like(inputs[0])
                with torch.no_grad():
                    fwd = triton.testing.do_bench(lambda a=attend, i=inputs: a(*i), warmup=50, rep=300)
                both = triton.testing.do_bench(
                    lambda a=attend, i=inputs, g=grad_out: a(*i).backward(g), warmup=50, rep=300, grad_to_none=inputs
                )
                record = {"tree": args.tree, "round": args.round, "head_dim": head_dim, "impl": name,
                          "rows": ROWS, "heads": HEADS, "seq": SEQ, "documents": documents, "longest": longest,
                          "fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": flops / fwd / 1e9,
                          "fwd_bwd_tflops": 3.5 * flops / both / 1e9}  # fmt: skip
                out.write(json.dumps(with_environment(record)) + "\n")
                print(args.tree, args.round, head_dim, name, f"fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
