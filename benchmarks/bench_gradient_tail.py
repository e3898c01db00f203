"""What follows a bucketed step's bf16 all-reduce, kernels only, on one GPU: the small preset's 111
gradients (113.8 M fp32 values) against one flat bf16 bucket holding them at 64-element alignment.

    cast in             the fp32 gradients copied into the bucket (bf16), one multi-tensor copy
    old tail            synchronize, then clip: copy back to fp32, per-tensor norms of the fp32
                        gradients, multiply every gradient by the clip coefficient
    new tail (torch)    norms of the bf16 views, then `torch.mul` of the bucket by a one-element
                        fp32 coefficient (fp32 out, one pass)
    torch.mul cast, plain cast   that multiply alone; `buffer.float()`
    triton scaled cast, triton cast   `fastlm.ops.scaled_cast` with and without the coefficient

Median ms by triton.testing.do_bench; one record per line into RESULTS (default
benchmarks/results/gradient_tail.jsonl). Usage: python benchmarks/bench_gradient_tail.py
"""

import os
from pathlib import Path

import torch
import triton

from fastlm.model import ModelConfig, TransformerLM
from fastlm.ops.scaled_cast import scaled_cast
from fastlm.utils.records import append_records, with_environment


def main() -> None:
    model = TransformerLM(ModelConfig.preset("small", vocab_size=320, context_length=2048)).cuda()
    params = list(model.parameters())
    grads = [torch.randn_like(p) for p in params]
    offsets, end = [], 0
    for p in params:
        offsets.append(end)
        end += -(-p.numel() // 64) * 64
    buffer = torch.randn(end, device="cuda").bfloat16()
    views = [buffer[o : o + p.numel()].view(p.shape) for o, p in zip(offsets, params, strict=True)]
    scale = torch.ones(1, device="cuda")

    def old_tail():
        torch._foreach_copy_(grads, views)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))
        torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))

    def new_norm():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(views, 2.0, dtype=torch.float32)))

    def new_tail():
        return torch.mul(buffer, torch.clamp(1.0 / (new_norm() + 1e-6), max=1.0).reshape(1))

    variants = {
        "cast in": lambda: torch._foreach_copy_(views, grads),
        "old tail": old_tail,
        "new tail (torch)": new_tail,
        "new norm": new_norm,
        "torch.mul cast": lambda: torch.mul(buffer, scale),
        "plain cast": lambda: buffer.float(),
        "triton scaled cast": lambda: scaled_cast(buffer, torch.float32, scale),
        "triton cast": lambda: scaled_cast(buffer, torch.float32),
    }
    print(f"{len(params)} tensors, {end / 1e6:.1f} M elements")
    records = []
    for name, fn in variants.items():
        ms = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")
        print(f"{name:20s} {ms:.3f} ms")
        records.append(with_environment({"op": "gradient_tail", "variant": name, "ms": ms, "elements": end}))
    append_records(Path(os.environ.get("RESULTS", "benchmarks/results/gradient_tail.jsonl")), records)


if __name__ == "__main__":
    main()
