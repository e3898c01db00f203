"""Time one AdamW step over the xl-width model's parameters: torch fused, torch foreach, fastlm.

torch.optim.AdamW (fused=True, foreach=True) against fastlm.optim.AdamW, in ms and in GB/s of 28
bytes per parameter, against the copy bandwidth measured in the same run.

Parameters: TransformerLM(ModelConfig.preset("xl", num_layers=--layers)) on the GPU, fp32; with
12 layers 523.6M parameters in 111 tensors. Gradients are drawn once at random. Each implementation
steps its own optimizer (its own states) over these parameters and gradients, lr 1e-4 as `fastlm
bench model` uses. Bytes per step: read param, grad, exp_avg, exp_avg_sq, write param, exp_avg,
exp_avg_sq: 28 per parameter (14.7 GB at 12 layers), the floor for fp32 states. Copy:
`dst.copy_(src)` of as many fp32 elements as parameters (8 bytes each: read + write). GPU memory:
about 4.2 GB per optimizer's states plus 8.4 GB for parameters, gradients and the copy buffers.

Protocol: a round gives each implementation (and the copy) --warmup steps, then --steps steps back
to back with a CUDA event pair around each, synchronized at the end, so an event pair spans the
step's GPU work and the host runs ahead (its time per optimizer.step() call is reported apart, as
host_ms). --rounds rounds interleave the implementations, so clock and thermal drift reach them
alike. Reported: the median over all timed steps, p20 / p80, and each round's median.

Usage: python benchmarks/bench_adamw.py [--layers 12] [--rounds 3] [--steps 20]
       [--configs 4096x8,8192x8] [--out benchmarks/results/adamw.jsonl]
--configs adds a fastlm row per launch configuration BLOCKxWARPS (default: only the configuration
adamw_config picks). Appends one record per implementation to --out and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastlm.model import ModelConfig, TransformerLM
from fastlm.ops.common import device_arch
from fastlm.optim import AdamW, AdamWConfig, adamw_config
from fastlm.utils.records import append_records, with_environment

BYTES_PER_PARAMETER = 28  # fp32: read p, g, m, v (16), write p, m, v (12)
LR = 1e-4


def time_round(step: Callable[[], object], warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(GPU ms, host ms) of each of ``steps`` back-to-back calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    host_ms = []
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        begin = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - begin) * 1e3)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events], host_ms


def parse_configs(text: str) -> list[AdamWConfig]:
    """'4096x8,8192x8' -> AdamWConfig(4096, 8), AdamWConfig(8192, 8)."""
    configs = []
    for item in filter(None, text.split(",")):
        block, _, warps = item.partition("x")
        if not (block.isdigit() and warps.isdigit()) or int(block) & (int(block) - 1):
            sys.exit(f"--configs: expected BLOCKxWARPS with BLOCK a power of two, got {item!r}")
        configs.append(AdamWConfig(int(block), int(warps)))
    return configs


def implementations(params: list[torch.nn.Parameter], configs: list[AdamWConfig]) -> dict[str, torch.optim.Optimizer]:
    """Name -> optimizer over ``params``; the fastlm names carry their launch configuration."""
    optimizers = {
        "torch fused": torch.optim.AdamW(params, lr=LR, fused=True),
        "torch foreach": torch.optim.AdamW(params, lr=LR, foreach=True),
    }
    for config in configs:
        optimizers[f"fastlm {config.block}x{config.num_warps}"] = AdamW(params, lr=LR, config=config)
    return optimizers


def summary(gpu_rounds: list[list[float]], host_rounds: list[list[float]]) -> dict:
    gpu = [t for times in gpu_rounds for t in times]
    deciles = statistics.quantiles(gpu, n=10, method="inclusive")
    return {
        "step_ms": statistics.median(gpu),
        "p20_ms": deciles[1],
        "p80_ms": deciles[7],
        "round_median_ms": [statistics.median(times) for times in gpu_rounds],
        "host_ms": statistics.median(t for times in host_rounds for t in times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="blocks of the xl width (default 12; xl has 48)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round (default 5)")
    parser.add_argument("--configs", default="", help="fastlm launch configurations BLOCKxWARPS, comma-separated")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/adamw.jsonl"),
        help="JSONL file to append the records to (default %(default)s)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adamw.py needs a CUDA GPU")
    device = torch.device("cuda")
    picked = adamw_config(device_arch(device), torch.float32)
    configs = [picked, *(c for c in parse_configs(args.configs) if c != picked)]

    torch.manual_seed(0)
    model_config = ModelConfig.preset("xl", num_layers=args.layers)
    with device:
        params = list(TransformerLM(model_config).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    numel = sum(p.numel() for p in params)
    optimizers = implementations(params, configs)
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    steps: dict[str, Callable[[], object]] = {name: opt.step for name, opt in optimizers.items()}
    steps["copy"] = lambda: dst.copy_(src)
    print(f"{len(params)} tensors, {numel / 1e6:.1f}M parameters, {torch.cuda.get_device_name()}", flush=True)

    gpu_ms: dict[str, list[list[float]]] = {name: [] for name in steps}
    host_ms: dict[str, list[list[float]]] = {name: [] for name in steps}
    for round_index in range(args.rounds):
        for name, step in steps.items():
            gpu, host = time_round(step, args.warmup, args.steps)
            gpu_ms[name].append(gpu)
            host_ms[name].append(host)
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)

    copy = summary(gpu_ms.pop("copy"), host_ms.pop("copy"))
    copy_gbps = 8 * numel / copy["step_ms"] / 1e6
    base = {
        "bench": "adamw",
        "model": "xl",
        "num_layers": args.layers,
        "parameters": numel,
        "tensors": len(params),
        "bytes_per_step": BYTES_PER_PARAMETER * numel,
        "copy_ms": copy["step_ms"],
        "copy_gbps": copy_gbps,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup": args.warmup,
    }
    records = []
    print(f"copy: {copy['step_ms']:.2f} ms, {copy_gbps:.0f} GB/s")
    print(
        f"{'implementation':<20}{'step ms':>9}{'p20-p80':>16}{'round medians':>24}{'GB/s':>7}{'of copy':>9}"
        f"{'host ms':>9}"
    )
    for name in gpu_ms:
        result = summary(gpu_ms[name], host_ms[name])
        gbps = BYTES_PER_PARAMETER * numel / result["step_ms"] / 1e6
        config = next((c for c in configs if name == f"fastlm {c.block}x{c.num_warps}"), None)
        records.append(
            with_environment(
                {
                    **base,
                    "implementation": name,
                    **result,
                    "gbps": gbps,
                    "fraction_of_copy": gbps / copy_gbps,
                    "block": config and config.block,
                    "num_warps": config and config.num_warps,
                    "picked_config": config == picked,
                }
            )
        )
        rounds = "/".join(f"{t:.2f}" for t in result["round_median_ms"])
        spread = f"{result['p20_ms']:.2f}-{result['p80_ms']:.2f}"
        print(
            f"{name:<20}{result['step_ms']:>9.2f}{spread:>16}{rounds:>24}{gbps:>7.0f}{gbps / copy_gbps:>9.2f}"
            f"{result['host_ms']:>9.2f}"
        )
    append_records(args.out, records)
    print(f"appended {len(records)} records to {args.out}")


if __name__ == "__main__":
    main()
