"""Where the time of one LayerNorm fwd+bwd through autograd goes (the benchmark's fwd+bwd row):
GPU kernels with their durations, and the wall time of the call, bf16 against fp32, for fastlm and
torch.compile. Then the host's own time per forward call and per backward call, without the
profiler: 50 calls queued without synchronizing (about 300 launches, under the launch queue's
depth, so no call waits for the GPU), timed with the CPU clock.
Usage: python benchmarks/profile_norm_step.py"""

import functools
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fastlm
from fastlm.ops import layer_norm as layer_norm_module


def main():
    compiled = torch.compile(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), dynamic=False)
    for name, fn in (("fastlm", fastlm.layer_norm), ("compile", compiled)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(32768, 1024, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(1024, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(1024, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)
            for _ in range(5):
                fn(x, w, b).backward(dy)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    x.grad = w.grad = b.grad = None
                    fn(x, w, b).backward(dy)
                torch.cuda.synchronize()
            print(f"== {name} {dtype}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            forward_us, backward_us = host_times(fn, x, w, b, dy)
            print(f"host time per call: forward {forward_us:.1f} us, backward {backward_us:.1f} us")
            if name == "fastlm":  # the launchers alone, without autograd
                _, mean, rstd = layer_norm_module._forward(x, w, b, 1e-5, False, dtype)
                launch_forward = host_median(functools.partial(layer_norm_module._forward, x, w, b, 1e-5, False, dtype))
                launch_backward = host_median(
                    functools.partial(layer_norm_module._backward, dy, x, w, mean, rstd, False, True, True)
                )
                print(f"launchers alone: forward {launch_forward:.1f} us, backward {launch_backward:.1f} us")
            print()


def host_median(call, calls=50):
    """Median CPU microseconds of ``call``, nothing synchronized between calls."""
    times = []
    torch.cuda.synchronize()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * sorted(times)[calls // 2]


def host_times(fn, x, w, b, dy, calls=50):
    """Median CPU microseconds of the forward call and of the backward call, nothing synchronized
    between calls (the GPU runs behind)."""
    forward, backward = [], []
    torch.cuda.synchronize()
    for _ in range(calls):
        x.grad = w.grad = b.grad = None
        start = time.perf_counter()
        y = fn(x, w, b)
        middle = time.perf_counter()
        y.backward(dy)
        end = time.perf_counter()
        forward.append(middle - start)
        backward.append(end - middle)
    torch.cuda.synchronize()
    return 1e6 * sorted(forward)[calls // 2], 1e6 * sorted(backward)[calls // 2]


if __name__ == "__main__":
    main()
