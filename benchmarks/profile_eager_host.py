"""Eager host time per call of fastlm's flash attention and RMSNorm against PyTorch's ops, at
shapes where the host dominates, then a cProfile of fastlm's attention (fwd+bwd and fwd).

Each case runs 200 calls back to back, 5 times; the middle of the 5 per-call times is printed
(the GPU work of these shapes is a few microseconds, so the loop measures the host path). The
RMSNorm cases take a bf16 x and an fp32 weight, as the model's norms under autocast do.
Usage: python benchmarks/profile_eager_host.py  (a CUDA GPU)
"""

import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

from fastlm import flash_attention, rms_norm

B, H, N, D = 1, 8, 128, 64
ROWS, WIDTH = 64, 1024


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(WIDTH, device="cuda", requires_grad=True)
    gx = torch.randn_like(x)
    cases = {
        "fastlm attn": lambda: flash_attention(q, k, v, causal=True).backward(g),
        "sdpa attn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g),
        "fastlm attn fwd": lambda: flash_attention(q, k, v, causal=True),
        "sdpa attn fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "fastlm rms": lambda: rms_norm(x, w).backward(gx),
        "torch rms": lambda: F.rms_norm(x, (WIDTH,), w).backward(gx),
    }
    for name, call in cases.items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                call()
            per_call.append((time.perf_counter() - start) / 200 * 1e6)
            torch.cuda.synchronize()
        print(f"{name}: {sorted(per_call)[2]:.1f} us per call (host loop; min {min(per_call):.1f})")
    for name in ("fastlm attn", "fastlm attn fwd"):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            cases[name]()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print("==", name)
        print(text.getvalue())


if __name__ == "__main__":
    main()
