"""Where the GPU time of the compiled training step goes, per kernel set: which share the kernels that
fastlm can replace (attention, norms, loss) hold, and what the rest is.

A model of a preset's width (xl by default: d 1600, ff 6400, 25 heads; --layers of its blocks, 12
by default so it compiles in about a minute), batch 4 (--batch) x 512 (--context), bf16 autocast, fused AdamW, compiled
as `fastlm bench model` does (same step, optimizer and compile modes). Per kernel set and compile
mode: the median of 20 steps, then 3 steps under torch.profiler; every GPU kernel is put in one
category by its name, and the table gives ms per step per category, the kernels launched per step
and the GPU's idle time per step (the step's span on the GPU timeline minus the union of its
kernels). With --compile cudagraphs the host cost is gone, so the GPU time per step bounds what a
faster kernel set can gain. --cpu-ops N prints the N CPU ops with the most self time per step for
each configuration (where a host-bound step spends its time), --gpu-kernels N the N GPU kernels with
the most time per step and their categories (which kernels a category holds); --trace DIR writes each profile as
a gzipped Chrome trace (bulky: keep DIR out of the repository).

Usage: python benchmarks/profile_compiled_step.py [--preset xl] [--layers 12] [--batch 4] [--context 512]
       [--compile compile,cudagraphs] [--optimizer torch,fastlm,fastlm-bf16] [--cpu-ops 25] [--gpu-kernels 30]
       [--trace DIR]
Writes results/profile_compiled_step.jsonl and prints the table.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fastlm.bench.distributed.timeline import gpu_timeline
from fastlm.harness.steps import Row, make_optimizer, make_step, time_steps
from fastlm.model import ModelConfig, TransformerLM
from fastlm.optim import AdamW
from fastlm.settings import TORCH_COMPILE_MODE
from fastlm.utils.records import append_records, with_environment

# The optimizer of each step: PyTorch's fused AdamW (what `fastlm bench model` uses), fastlm's, or
# fastlm's with the matmul weights stored in bf16 (fp32 masters).
OPTIMIZERS = {
    "torch": make_optimizer,
    "fastlm": lambda model: AdamW(model.parameters(), lr=1e-4),
    "fastlm-bf16": lambda model: make_optimizer(model, "bf16-weights"),
}

# First match wins: a kernel's name decides its category.
CATEGORIES = (
    ("matmul", re.compile(r"nvjet|gemm|cutlass|xmma|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention", re.I)),
    ("norm (fastlm)", re.compile(r"_norm_|_sum_partials")),
    ("loss (fastlm)", re.compile(r"_cross_entropy|_scale_rows")),
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("Inductor fused", re.compile(r"^triton_")),
    ("copy / fill", re.compile(r"copy|memcpy|memset|fill", re.I)),
)


def category(kernel_name: str) -> str:
    return next((name for name, pattern in CATEGORIES if pattern.search(kernel_name)), "other")


def gpu_kernels(prof: profile, steps: int) -> dict[str, tuple[float, float]]:
    """Each GPU kernel's (us per step, launches per step) from the profiler's GPU events."""
    us: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation:  # kernels, not ranges
            us[event.name] += event.device_time_total / steps
            launches[event.name] += 1
    return {name: (us[name], launches[name] / steps) for name in us}


def gpu_time_by_category(kernels: dict[str, tuple[float, float]]) -> tuple[dict[str, float], float]:
    """(ms per step per category, kernels launched per step) from `gpu_kernels`."""
    ms: dict[str, float] = defaultdict(float)
    for name, (us, _) in kernels.items():
        ms[category(name)] += us / 1e3
    return dict(ms), sum(launches for _, launches in kernels.values())


def cpu_ops_table(prof: profile, steps: int, rows: int) -> str:
    """The ``rows`` CPU ops with the most self time, in ms per step, with their calls per step."""
    ops = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    lines = [f"{'self ms/step':>12} {'calls/step':>10}  op"]
    lines += [f"{e.self_cpu_time_total / 1e3 / steps:12.3f} {e.count / steps:10.1f}  {e.key[:100]}" for e in ops[:rows]]
    return "\n".join(lines)


def gpu_kernels_table(kernels: dict[str, tuple[float, float]], rows: int) -> str:
    """The ``rows`` GPU kernels of `gpu_kernels` with the most time, in us per step, with their
    launches per step and category."""
    lines = [f"{'us/step':>9} {'calls/step':>10}  {'category':<14} kernel"]
    for name, (us, launches) in sorted(kernels.items(), key=lambda item: -item[1][0])[:rows]:
        lines.append(f"{us:9.1f} {launches:10.1f}  {category(name):<14} {name[:90]}")
    return "\n".join(lines)


def measure(kernels: str, compile_mode: str, optimizer: str, args: argparse.Namespace, tokens: torch.Tensor) -> dict:
    config = ModelConfig.preset(args.preset, num_layers=args.layers, context_length=args.context).with_kernels(kernels)
    with torch.device(tokens.device):
        model = TransformerLM(config)
    row = Row("train", "bf16", compile_mode)
    module = torch.compile(model, mode=TORCH_COMPILE_MODE[compile_mode])
    step = make_step(module, model, row, tokens, tokens, OPTIMIZERS[optimizer](model))
    times = time_steps(step, warmup=5, steps=20, device=tokens.device)
    profiled_steps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled_steps):
            step()
        torch.cuda.synchronize()
    kernels_run = gpu_kernels(prof, profiled_steps)
    gpu_ms, kernels_per_step = gpu_time_by_category(kernels_run)
    name = f"{args.preset} {kernels} {compile_mode} {optimizer} AdamW"
    if args.cpu_ops:
        print(f"CPU ops of {name}:\n{cpu_ops_table(prof, profiled_steps, args.cpu_ops)}", flush=True)
    if args.gpu_kernels:
        print(f"GPU kernels of {name}:\n{gpu_kernels_table(kernels_run, args.gpu_kernels)}", flush=True)
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.trace / f"{name.replace(' ', '_')}.json.gz"))
    return {
        "op": "profile_compiled_step",
        "preset": args.preset,
        "kernels": kernels,
        "compile": compile_mode,
        "optimizer": optimizer,
        "num_layers": config.num_layers,
        "d_model": config.d_model,
        "batch": tokens.shape[0],
        "context_length": tokens.shape[1],
        "first_step_ms": times[0],
        "step_ms": statistics.median(times[5:]),
        "gpu_ms": sum(gpu_ms.values()),
        "gpu_idle_ms": gpu_timeline(prof.profiler.kineto_results.events()).usage(profiled_steps)["idle_ms"],
        "gpu_ms_by_category": gpu_ms,
        "kernels_per_step": kernels_per_step,
    }


def render(records: list[dict]) -> str:
    names = [name for name, _ in CATEGORIES] + ["other"]
    head = ["preset", "kernels", "compile", "optimizer", "step ms", "GPU ms", "GPU idle ms", "kernels/step", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        cells = [
            r.get("preset", "xl"),
            r["kernels"],
            r["compile"],
            r["optimizer"],
            f"{r['step_ms']:.1f}",
            f"{r['gpu_ms']:.1f}",
            f"{r['gpu_idle_ms']:.1f}" if "gpu_idle_ms" in r else "-",
            f"{r['kernels_per_step']:.0f}",
        ]
        cells += [f"{r['gpu_ms_by_category'].get(n, 0.0):.2f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="xl", help="model preset whose width to use (default xl)")
    p.add_argument("--layers", type=int, default=12, help="blocks of the preset's width (default 12; xl has 48)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--context", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--kernels", default="torch,fastlm", help="comma list (default torch,fastlm)")
    p.add_argument("--compile", default="compile,cudagraphs", help="comma list (default compile,cudagraphs)")
    p.add_argument("--optimizer", default="torch", help="comma list of torch, fastlm, fastlm-bf16 (default torch)")
    p.add_argument("--out", type=Path, default=Path("benchmarks"), help="folder for results/ (default benchmarks)")
    p.add_argument("--cpu-ops", type=int, default=0, help="print this many CPU ops by self time (default 0)")
    p.add_argument("--gpu-kernels", type=int, default=0, help="print this many GPU kernels by time (default 0)")
    p.add_argument("--trace", type=Path, help="folder for gzipped Chrome traces (default: none)")
    args = p.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, 10000, (args.batch, args.context), device="cuda")
    records = []
    for compile_mode in args.compile.split(","):
        for kernels in args.kernels.split(","):
            for optimizer in args.optimizer.split(","):
                record = with_environment(measure(kernels, compile_mode, optimizer, args, tokens))
                print(
                    f"{args.preset} {kernels} {compile_mode} {optimizer} AdamW: step {record['step_ms']:.1f} ms,"
                    f" GPU {record['gpu_ms']:.1f} ms, idle {record['gpu_idle_ms']:.1f} ms",
                    flush=True,
                )
                records.append(record)
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    append_records(args.out / "results" / "profile_compiled_step.jsonl", records)
    print(render(records))


if __name__ == "__main__":
    main()
