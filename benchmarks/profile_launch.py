"""Host cost of one Triton kernel launch: Triton's dispatcher against fastlm's direct launch.

    python3 benchmarks/profile_launch.py [--out benchmarks/results]

A kernel with a norm-like signature (6 tensors, 5 integers, a float, 4 constexprs) on a 64-row
input, launched n times back to back and then synchronized: with kernels this small the loop is
host-bound, so the time per launch is the Python and driver cost of one launch. Compared:
`kernel[grid](...)` (Triton's dispatcher), `eager_kernel(kernel)[grid](...)` (fastlm.ops.launch),
and `torch.empty` + `torch.add` as the scale of a PyTorch op's host cost. Median and spread over
rounds; one JSONL record per path with --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from fastlm.bench.records import append_records, environment
from fastlm.ops.launch import eager_kernel


@triton.jit
def _probe_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, M, D, eps,
                  RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], x, mask=mask)


def per_launch_us(launch, n: int, rounds: int) -> list[float]:
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
        values = per_launch_us(launch, args.n, args.rounds)
        median = statistics.median(values)
        print(f"{name:<26} {median:>20.2f} ({min(values):.2f}-{max(values):.2f})")
        records.append({"bench": "launch", "path": name, "us_median": median, "us_min": min(values),
                        "us_max": max(values), "rounds": args.rounds, "n": args.n,
                        "direct_launch": direct.direct, **environment()})  # fmt: skip
    if args.out is not None:
        append_records(args.out / "launch.jsonl", records)


if __name__ == "__main__":
    main()
