"""A/B: the short-sequence tile entry against the long-sequence one at the same shapes (the GPU's
`attention_config` for N <= SHORT_SEQ keys and for longer), causal bf16 through autograd, with
SDPA's cuDNN backend beside them. Contiguous (B, H, N, D) inputs; ROUNDS rounds of do_bench per
variant, forward alone (no grad) and forward + backward; one record per (shape, variant, round).

    python benchmarks/ab_attention_tiles.py OUT.jsonl --shapes 32,16,1024,128 1,32,1024,128
"""

import argparse
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastlm.ops.common import device_arch
from fastlm.ops.flash_attention import SHORT_SEQ, FlashAttentionTriton, attention_config
from fastlm.utils.records import with_environment

ROUNDS = 3


def measure(B: int, H: int, N: int, D: int, out) -> None:
    """ROUNDS rounds of every variant at one shape, records appended to ``out``."""
    assert N <= SHORT_SEQ, f"N={N}: the short-sequence entry serves at most {SHORT_SEQ} keys"
    arch = device_arch(torch.device("cuda"))
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    grad_out = torch.randn_like(q)
    configs = {"short": attention_config(arch, q.dtype, D, N), "long": attention_config(arch, q.dtype, D)}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    runs = {name: lambda c=c: FlashAttentionTriton.apply(q, k, v, True, None, c) for name, c in configs.items()}
    runs["sdpa-cudnn"] = cudnn
    flops = 2 * B * H * N * N * D  # causal forward; forward + backward counts 3.5x
    for round_ in range(ROUNDS):
        for name, forward in runs.items():
            with torch.no_grad():
                fwd = triton.testing.do_bench(forward, warmup=25, rep=100)
            both = triton.testing.do_bench(
                lambda f=forward: f().backward(grad_out), warmup=25, rep=100, grad_to_none=[q, k, v]
            )
            record = {"shape": [B, H, N, D], "impl": name, "round": round_, "fwd_ms": fwd, "fwd_bwd_ms": both,
                      "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3.5 * flops / both / 1e9}  # fmt: skip
            out.write(json.dumps(with_environment(record)) + "\n")
            print(record["shape"], name, round_, f"fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSONL file the records are appended to")
    parser.add_argument("--shapes", nargs="+", required=True, help="B,H,N,D with N <= SHORT_SEQ")
    args = parser.parse_args()
    with open(args.out, "a") as out:
        for shape in args.shapes:
            measure(*(int(x) for x in shape.split(",")), out)


if __name__ == "__main__":
    main()
