"""Where the host time of one eager fwd+bwd call goes, per op, against the PyTorch op it replaces.

For each case: the wall time per call of 200 calls back to back (median of 5 rounds), then a
torch.profiler table of the calls' host-side events (self CPU time: Python ops, the CUDA driver
and runtime calls, allocations), then a cProfile of the same calls sorted by own time. Shapes:
the host-bound ones of `fastlm bench host` and the 16384 x 4096 norm, whose eager fwd+bwd runs at
a third of its CUDA-graph bandwidth on an H200.
Usage: python benchmarks/profile_host_ops.py [--out DIR]  (a CUDA GPU)
"""

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastlm import flash_attention, layer_norm, rms_norm


def _cases() -> dict:
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    small, small_w = leaf(64, 1024), leaf(1024, dtype=torch.float32)
    big, big_w, big_b = leaf(16384, 4096), leaf(4096), leaf(4096)
    q, k, v = (leaf(1, 8, 128, 64) for _ in range(3))
    g_small, g_big, g_attn = torch.randn(64, 1024, **bf16), torch.randn(16384, 4096, **bf16), torch.randn_like(q)
    return {
        "rms 64x1024 fastlm": lambda: rms_norm(small, small_w).backward(g_small),
        "rms 64x1024 torch": lambda: F.rms_norm(small, (1024,), small_w).backward(g_small),
        "layer 16384x4096 fastlm": lambda: layer_norm(big, big_w, big_b).backward(g_big),
        "layer 16384x4096 torch": lambda: F.layer_norm(big, (4096,), big_w, big_b).backward(g_big),
        "attn 1x8x128x64 fastlm": lambda: flash_attention(q, k, v, causal=True).backward(g_attn),
        "attn 1x8x128x64 sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g_attn),
    }


def _per_call_us(call, calls: int = 200, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[rounds // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the full text here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = _cases()
    lines = []
    for name, call in cases.items():
        for _ in range(20):
            call()
        lines.append(f"{name}: {_per_call_us(call):.1f} us per fwd+bwd call (wall, 200 back to back)")
        print(lines[-1], flush=True)
    for name, call in cases.items():
        if not name.endswith("fastlm") and "torch" not in name and "sdpa" not in name:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        lines += [f"== torch.profiler, 50 calls: {name}", table]
        if name.endswith("fastlm"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                call()
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            lines += [f"== cProfile, 200 calls: {name}", text.getvalue()]
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_host_ops.txt").write_text(report)


if __name__ == "__main__":
    main()
