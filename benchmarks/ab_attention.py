"""A/B of two launch configurations of the attention kernels, causal bf16 through autograd, with
SDPA's cuDNN backend beside them; ROUNDS rounds of do_bench per variant, forward alone (no grad) and
forward + backward; one record per (shape, variant, round).

- descriptors: the forward with its tiles loaded through TMA descriptors (the D=128 default on
  sm90) against the same kernel and tiles through pointers, on token-major (B, N, H, D) inputs
  viewed as (B, H, N, D), as the model hands them; checks first that both give the same bits.
- tiles: the short-sequence tile entry against the long-sequence one (the GPU's `attention_config`
  for N <= SHORT_SEQ keys and for longer), on contiguous (B, H, N, D) inputs.

    python benchmarks/ab_attention.py descriptors OUT.jsonl --shapes 8,16,4096,128 2,16,16384,128
    python benchmarks/ab_attention.py tiles OUT.jsonl --shapes 32,16,1024,128 8,16,2048,128
"""

import argparse
import dataclasses
import json

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastlm.ops.common import device_arch
from fastlm.ops.flash_attention import SHORT_SEQ, FlashAttentionTriton, attention_config
from fastlm.ops.flash_attention.launchers import _descriptors_fit
from fastlm.utils.records import with_environment

ROUNDS = 3


def descriptor_configs(q, k, v) -> dict:
    """name -> AttentionConfig: the default forward through descriptors, and through pointers."""
    descriptors = attention_config(device_arch(q.device), q.dtype, q.shape[-1], k.shape[-2])
    assert descriptors.forward_descriptors, "this GPU's forward at this head dim loads through pointers"
    assert _descriptors_fit(q, k, v), "the inputs would take the pointer loads"
    return {"descriptors": descriptors, "pointers": dataclasses.replace(descriptors, forward_descriptors=False)}


def tile_configs(q, k, v) -> dict:
    """name -> AttentionConfig: the short-sequence entry and the long-sequence one."""
    N = k.shape[-2]
    assert N <= SHORT_SEQ, f"N={N}: the short-sequence entry serves at most {SHORT_SEQ} keys"
    arch, D = device_arch(q.device), q.shape[-1]
    return {"short": attention_config(arch, q.dtype, D, N), "long": attention_config(arch, q.dtype, D)}


COMPARISONS = {  # name -> (inputs token-major, configs, whether the variants must agree bit for bit)
    "descriptors": (True, descriptor_configs, True),
    "tiles": (False, tile_configs, False),
}


def measure(comparison: str, B: int, H: int, N: int, D: int, out) -> None:
    """ROUNDS rounds of every variant at one shape, records appended to ``out``."""
    token_major, make_configs, same_bits = COMPARISONS[comparison]
    layout = (B, N, H, D) if token_major else (B, H, N, D)
    q, k, v = (
        (t.transpose(1, 2) if token_major else t).requires_grad_()
        for t in (torch.randn(layout, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    )
    grad_out = torch.randn_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    configs = make_configs(q, k, v)
    runs = {name: lambda c=c: FlashAttentionTriton.apply(q, k, v, True, None, c) for name, c in configs.items()}
    if same_bits:
        first, second = (run() for run in runs.values())
        assert torch.equal(first, second), "the variants' outputs differ"
    runs["sdpa-cudnn"] = cudnn
    flops = 2 * B * H * N * N * D  # causal forward; forward + backward counts 3.5x
    for round_ in range(ROUNDS):
        for name, forward in runs.items():
            with torch.no_grad():
                fwd = triton.testing.do_bench(forward, warmup=50, rep=200)
            both = triton.testing.do_bench(
                lambda f=forward: f().backward(grad_out), warmup=50, rep=200, grad_to_none=[q, k, v]
            )
            record = {"comparison": comparison, "shape": [B, H, N, D], "impl": name, "round": round_,
                      "fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": flops / fwd / 1e9,
                      "fwd_bwd_tflops": 3.5 * flops / both / 1e9}  # fmt: skip
            out.write(json.dumps(with_environment(record)) + "\n")
            print(record["shape"], name, round_, f"fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparison", choices=sorted(COMPARISONS))
    parser.add_argument("out", help="JSONL file the records are appended to")
    parser.add_argument("--shapes", nargs="+", required=True, help="B,H,N,D")
    args = parser.parse_args()
    with open(args.out, "a") as out:
        for shape in args.shapes:
            measure(args.comparison, *(int(x) for x in shape.split(",")), out)


if __name__ == "__main__":
    main()
