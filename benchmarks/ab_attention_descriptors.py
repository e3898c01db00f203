"""A/B: the causal bf16 forward with its tiles loaded through TMA descriptors (the D=128 default on
sm90) against the same kernel and tiles through pointers, with SDPA's cuDNN backend beside them.
Token-major (B, N, H, D) inputs viewed as (B, H, N, D), as the model hands them; checks that both
forwards give the same bits first, then ROUNDS rounds of do_bench per variant, forward alone (no
grad) and forward + backward through autograd; one record per (shape, variant, round).

    python benchmarks/ab_attention_descriptors.py benchmarks/results/attention_descriptors_ab.jsonl
"""

import argparse
import dataclasses
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastlm.ops.common import device_arch
from fastlm.ops.flash_attention import FlashAttentionTriton, attention_config
from fastlm.ops.flash_attention.launchers import _descriptors_fit
from fastlm.utils.records import with_environment

SHAPES = ((8, 16, 4096, 128), (2, 16, 16384, 128), (1, 32, 1024, 128))  # (B, H, N, D)
ROUNDS = 3


def variants(q, k, v):
    """name -> forward on (q, k, v), causal."""
    descriptors = attention_config(device_arch(q.device), q.dtype, q.shape[-1], k.shape[-2])
    assert descriptors.forward_descriptors, "this GPU's forward at this head dim loads through pointers"
    pointers = dataclasses.replace(descriptors, forward_descriptors=False)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "descriptors": lambda: FlashAttentionTriton.apply(q, k, v, True, None, descriptors),
        "pointers": lambda: FlashAttentionTriton.apply(q, k, v, True, None, pointers),
        "sdpa-cudnn": cudnn,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSONL file the records are appended to")
    args = parser.parse_args()
    with open(args.out, "a") as out:
        for B, H, N, D in SHAPES:
            q, k, v = (
                torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                for _ in range(3)
            )
            grad_out = torch.randn_like(q)
            runs = variants(q, k, v)
            assert _descriptors_fit(q, k, v), "the inputs would take the pointer loads"
            assert torch.equal(runs["descriptors"](), runs["pointers"]())
            flops = 2 * B * H * N * N * D  # causal forward; forward + backward counts 3.5x
            for round_ in range(ROUNDS):
                for name, forward in runs.items():
                    with torch.no_grad():
                        fwd = triton.testing.do_bench(forward, warmup=50, rep=200)
                    both = triton.testing.do_bench(
                        lambda f=forward, g=grad_out: f().backward(g), warmup=50, rep=200, grad_to_none=[q, k, v]
                    )
                    record = {"shape": [B, H, N, D], "impl": name, "round": round_, "fwd_ms": fwd,
                              "fwd_bwd_ms": both, "fwd_tflops": flops / fwd / 1e9,
                              "fwd_bwd_tflops": 3.5 * flops / both / 1e9}  # fmt: skip
                    out.write(json.dumps(with_environment(record)) + "\n")
                    print(record["shape"], name, round_, f"fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
