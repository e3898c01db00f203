"""Where the compiled step's time goes with PyTorch's RMSNorm against fastlm's: a 12-layer model of
the xl width (d 1600, ff 6400, 25 heads), batch 4 x 512, bf16 autocast, fused AdamW, compiled.
Per norm kernel set: first step, median of 20 steps, then 3 steps under torch.profiler (GPU
kernel time per step, kernels per step, top kernels). Output of the committed run:
benchmarks/reports/profile_compiled_norm_h100.txt.
Usage: python benchmarks/profile_compiled_norm.py
"""

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastlm.model import ModelConfig, TransformerLM


def measure(norm: str, tokens: torch.Tensor) -> None:
    cfg = ModelConfig(d_model=1600, d_ff=6400, num_layers=12, num_heads=25, norm=norm)
    model = TransformerLM(cfg).to(tokens.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cm = torch.compile(model)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cm(tokens, tokens)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    print(norm, "first step s", round(time.perf_counter() - t0, 1))
    for _ in range(3):
        step()
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    print(norm, "median ms", round(statistics.median(times), 2), "min", round(min(times), 2))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ev = list(prof.key_averages())
    gpu = sorted(ev, key=lambda e: -e.self_device_time_total)
    # (the sum counts a kernel once as itself and once under the CPU op that launched it)
    total = sum(e.self_device_time_total for e in ev) / 3 / 1e3
    kernels = sum(e.count for e in ev if e.self_device_time_total > 0) / 3
    print(norm, "GPU kernel ms per step", round(total, 2), "kernels per step", kernels)
    for e in gpu[:18]:
        print(f"  {e.key[:90]:90s} {e.count / 3:6.0f} {e.self_device_time_total / 3 / 1e3:8.3f} ms")


def main() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 10000, (4, 512), device="cuda")
    for norm in ("torch", "fastlm"):
        measure(norm, tokens)
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
