"""Where a Python autograd.Function's backward runs, and what that costs the host.

    python3 benchmarks/profile_backward_thread.py

For CUDA tensors the autograd engine runs backward on a worker thread per device; a backward
written in Python (every fastlm op's eager path) must take the GIL on that thread, while the
PyTorch ops' C++ backwards never do. This times fwd+bwd per call at a small shape (host-bound)
for a trivial Python Function, fastlm.rms_norm and F.rms_norm, with the engine's worker threads
(the default) and with `torch.autograd.set_multithreading_enabled(False)`, which runs backward on
the calling thread. Median and spread over rounds.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import fastlm


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()


def per_call_us(fn, n: int = 300, rounds: int = 7) -> list[float]:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    values = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        values.append((time.perf_counter() - start) / n * 1e6)
    return values


def main() -> None:
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def backward(y):
        x.grad = w.grad = None
        y.backward(dy)

    cases = {
        "x.clone()": lambda: backward(x.clone()),
        "Python Function (clone)": lambda: backward(_Identity.apply(x)),
        "F.rms_norm": lambda: backward(F.rms_norm(x, (1024,), w)),
        "fastlm.rms_norm": lambda: backward(fastlm.rms_norm(x, w)),
    }
    print(f"{'fwd+bwd per call, us':<26}{'worker thread (default)':>28}{'calling thread':>24}")
    for name, fn in cases.items():
        cells = []
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                values = per_call_us(fn)
            cells.append(f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})")
        print(f"{name:<26}{cells[0]:>28}{cells[1]:>24}")


if __name__ == "__main__":
    main()
