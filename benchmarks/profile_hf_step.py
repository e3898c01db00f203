"""Where a Hugging Face model's training step spends its GPU time, per patch: a diagnosis for
`fastlm bench hf`'s ratios.

The step of `fastlm bench hf` (forward, backward, fused AdamW, bf16 autocast over fp32 weights,
eager) is traced by torch.profiler for ``--steps`` steps after ``--warmup``; each kernel's device
time is summed into a category by its name (matmul, attention, norm, loss, ...), printed per patch
side by side in ms per step, then the longest kernels of each patch. Appends one record per
(patch, category) to benchmarks/results/hf_profile.jsonl.

    python3 benchmarks/profile_hf_step.py --family phi3 --size 3b --patches none,fastlm,liger
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fastlm.bench.hf import IMPLEMENTATIONS, HFShape, missing_patch
from fastlm.bench.options import HF_FAMILIES, HF_SIZES
from fastlm.harness.steps import Row, make_optimizer, make_step
from fastlm.utils.records import append_records, with_environment

ROOT = Path(__file__).resolve().parents[1]
# (category, pattern of the lowercased kernel name): the first that matches names the category
CATEGORIES = (
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|splitk|cublas"),
    ("attention", r"flash|fmha|attn|attention|sdpa|cudnn"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    ("loss", r"cross_entropy|xent|softmax|nll|logprob|linear_ce"),
    ("mlp activation", r"swiglu|geglu|silu|gelu|glu"),
    ("embedding", r"embedding|index|scatter|gather"),
    ("copies and casts", r"copy|cast|convert|cat"),
    ("reductions", r"reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
)


def category(name: str) -> str:
    lowered = name.lower()
    return next((c for c, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def kernel_times(patch: str, shape: HFShape, batch: int, warmup: int, steps: int) -> tuple[dict[str, float], float]:
    """(kernel name -> device ms per step of ``patch``'s training step, the median wall ms of 5
    steps without the profiler: the profiler lengthens short kernels, so the sums of a step of many
    of them exceed its wall time)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = IMPLEMENTATIONS[patch].make(shape).train()
        tokens = torch.randint(0, shape.vocab_size, (batch, shape.context_length))
    row = Row("train", "bf16", "eager")
    optimizer = make_optimizer(model, row.precision)
    step = make_step(lambda t, y: model(input_ids=t, labels=y).loss, model, row, tokens, tokens, optimizer)
    for _ in range(warmup):
        step()
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / 1e3 / steps
    return dict(times), statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=HF_FAMILIES, default="llama")
    parser.add_argument("--size", choices=HF_SIZES, default="1b")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--patches", default="none,fastlm,liger", help="comma-separated: none, fastlm, liger")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="longest kernels printed per patch")
    args = parser.parse_args()
    shape = HFShape.of(args.family, args.size, args.seq, num_layers=args.layers)
    patches = [p for p in args.patches.split(",") if missing_patch(p) is None]
    per_patch, wall = {}, {}
    for p in patches:
        per_patch[p], wall[p] = kernel_times(p, shape, args.batch, args.warmup, args.steps)
        torch.cuda.empty_cache()  # the model went with kernel_times' frame

    by_category = {p: defaultdict(float) for p in patches}
    for p, times in per_patch.items():
        for name, ms in times.items():
            by_category[p][category(name)] += ms
    names = [c for c, _ in CATEGORIES] + ["other"]
    print(f"{args.family} {args.size} ({shape.num_layers} layers), batch {args.batch} x {args.seq}: ms per step")
    print(f"{'category':>18} " + " ".join(f"{IMPLEMENTATIONS[p].name:>10}" for p in patches))
    for c in [*names, "total"]:
        values = [sum(by_category[p].values()) if c == "total" else by_category[p][c] for p in patches]
        print(f"{c:>18} " + " ".join(f"{v:10.2f}" for v in values))
    print(f"{'wall, unprofiled':>18} " + " ".join(f"{wall[p]:10.2f}" for p in patches))
    for p, times in per_patch.items():
        print(f"\n{IMPLEMENTATIONS[p].name}: longest kernels (ms per step)")
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {ms:8.2f}  {category(name):>16}  {name[:110]}")
        for c in ("copies and casts", "elementwise", "other"):
            kernels = sorted(((ms, n) for n, ms in times.items() if category(n) == c), reverse=True)[:4]
            print(f"  {c}: " + "; ".join(f"{ms:.2f} {n[:90]}" for ms, n in kernels))
    records = [
        with_environment(
            {
                "op": "hf_profile",
                "implementation": IMPLEMENTATIONS[p].name,
                "family": args.family,
                "size": args.size,
                "layers": shape.num_layers,
                "batch": args.batch,
                "seq": args.seq,
                "category": c,
                "device_ms_per_step": round(by_category[p][c], 3),
                "wall_ms_per_step": round(wall[p], 2),
            }
        )
        for p in patches
        for c in names
    ]
    append_records(ROOT / "benchmarks" / "results" / "hf_profile.jsonl", records)


if __name__ == "__main__":
    main()
