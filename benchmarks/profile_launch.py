"""Host cost of one Triton kernel launch (Triton's dispatcher against fastlm's direct launch), and
of the autograd engine's thread hop for a backward written in Python.

    python3 benchmarks/profile_launch.py [--out benchmarks/results]

A kernel with a norm-like signature (6 tensors, 5 integers, a float, 4 constexprs) on a 64-row
input, launched n times back to back and then synchronized: with kernels this small the loop is
host-bound, so the time per launch is the Python and driver cost of one launch. Compared:
`kernel[grid](...)` (Triton's dispatcher), `eager_kernel(kernel)[grid](...)` (fastlm.ops.launch),
and `torch.empty` + `torch.add` as the scale of a PyTorch op's host cost. Median and spread over
rounds; one JSONL record per path with --out.

Then fwd+bwd per call at a small shape for a trivial Python autograd.Function, fastlm.rms_norm and
F.rms_norm, with the engine's per-device worker thread (the default: a backward written in Python,
as every fastlm op's eager backward is, takes the GIL on that thread) and with
`torch.autograd.set_multithreading_enabled(False)` (backward on the calling thread).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fastlm
from fastlm.ops.launch import eager_kernel
from fastlm.utils.records import append_records, environment


@triton.jit
def _probe_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    stride_x,
    stride_y,
    M,
    D,
    eps,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], x, mask=mask)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return dy.clone()


def per_call_us(launch, n: int, rounds: int) -> list[float]:
    """Microseconds per call of ``launch`` over n back-to-back calls, one value per round."""
    for _ in range(20):
        launch()
    torch.cuda.synchronize()
    values = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            launch()
        torch.cuda.synchronize()
        values.append((time.perf_counter() - start) / n * 1e6)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="launches per round (default 2000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="append records to OUT/launch.jsonl")
    args = parser.parse_args()
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w, b, y = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda"), torch.empty_like(x)
    mean, rstd = torch.empty(64, device="cuda"), torch.empty(64, device="cuda")
    call = (x, w, b, y, mean, rstd, x.stride(0), y.stride(0), 64, 1024, 1e-5)
    constexprs = dict(RMS=True, HAS_BIAS=False, BLOCK_M=2, BLOCK_D=1024, num_warps=4)
    direct = eager_kernel(_probe_kernel)
    paths = {
        "triton dispatch": lambda: _probe_kernel[(32,)](*call, **constexprs),
        "fastlm direct": lambda: direct[(32,)](*call, **constexprs),
        "torch.empty + torch.add": lambda: torch.add(x, torch.empty_like(x), out=y),
    }
    records = []
    print(f"{'path':<26} {'us per launch (median, min-max over rounds)':>44}")
    for name, launch in paths.items():
        values = per_call_us(launch, args.n, args.rounds)
        median = statistics.median(values)
        print(f"{name:<26} {median:>20.2f} ({min(values):.2f}-{max(values):.2f})")
        records.append(
            {
                "bench": "launch",
                "path": name,
                "us_median": median,
                "us_min": min(values),
                "us_max": max(values),
                "rounds": args.rounds,
                "n": args.n,
                "direct_launch": direct.direct,
                **environment(),
            }
        )
    if args.out is not None:
        append_records(args.out / "launch.jsonl", records)
    backward_threads(x, w.to(x.dtype).requires_grad_(), rounds=args.rounds)


def backward_threads(x: torch.Tensor, w: torch.Tensor, rounds: int) -> None:
    x = x.detach().requires_grad_()
    dy = torch.randn_like(x)

    def backward(y):
        x.grad = w.grad = None
        y.backward(dy)

    cases = {
        "x.clone()": lambda: backward(x.clone()),
        "Python Function (clone)": lambda: backward(_Identity.apply(x)),
        "F.rms_norm": lambda: backward(F.rms_norm(x, x.shape[-1:], w)),
        "fastlm.rms_norm": lambda: backward(fastlm.rms_norm(x, w)),
    }
    print(f"{'fwd+bwd per call, us':<26}{'worker thread (default)':>28}{'calling thread':>24}")
    for name, fn in cases.items():
        cells = []
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                values = per_call_us(fn, 300, rounds)
            cells.append(f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})")
        print(f"{name:<26}{cells[0]:>28}{cells[1]:>24}")


if __name__ == "__main__":
    main()
