"""Where the GPU time of the compiled training step goes, per kernel set: which share the kernels that
fastlm can replace (attention, norms, loss) hold, and what the rest is.

A model of the xl width (d 1600, ff 6400, 25 heads; --layers of them, 12 by default so it compiles
in about a minute), batch 4 x 512, bf16 autocast, fused AdamW, compiled as `fastlm bench model` does
(same step, optimizer and compile modes). Per kernel set and compile mode: the median of 20 steps,
then 3 steps under torch.profiler; every GPU kernel is put in one category by its name, and the
table gives ms per step per category and the kernels launched per step. With --compile cudagraphs
the host cost is gone, so the GPU time per step bounds what a faster kernel set can gain.

Usage: python benchmarks/profile_compiled_step.py [--layers 12] [--compile compile,cudagraphs]
       [--optimizer torch,fastlm]
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

from fastlm.harness.records import append_records, with_environment
from fastlm.harness.steps import Row, make_optimizer, make_step, time_steps
from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.config import TORCH_COMPILE_MODE
from fastlm.optim import AdamW

# The optimizer of each step: PyTorch's fused AdamW (what `fastlm bench model` uses) or fastlm's.
OPTIMIZERS = {"torch": make_optimizer, "fastlm": lambda model: AdamW(model.parameters(), lr=1e-4)}

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


def gpu_time_by_category(prof: profile, steps: int) -> tuple[dict[str, float], float]:
    """(ms per step per category, kernels launched per step) from the profiler's GPU events."""
    ms: dict[str, float] = defaultdict(float)
    count = 0
    for event in prof.events():
        if event.device_type != DeviceType.CUDA or event.is_user_annotation:  # ranges, not kernels
            continue
        ms[category(event.name)] += event.device_time_total / 1e3 / steps
        count += 1
    return dict(ms), count / steps


def measure(kernels: str, compile_mode: str, optimizer: str, layers: int, tokens: torch.Tensor) -> dict:
    config = ModelConfig.preset("xl", num_layers=layers).with_kernels(kernels)
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
    gpu_ms, kernels_per_step = gpu_time_by_category(prof, profiled_steps)
    return {
        "op": "profile_compiled_step", "kernels": kernels, "compile": compile_mode, "optimizer": optimizer,
        "num_layers": layers,
        "d_model": config.d_model, "batch": tokens.shape[0], "context_length": tokens.shape[1],
        "first_step_ms": times[0], "step_ms": statistics.median(times[5:]),
        "gpu_ms": sum(gpu_ms.values()), "gpu_ms_by_category": gpu_ms, "kernels_per_step": kernels_per_step,
    }  # fmt: skip


def render(records: list[dict]) -> str:
    names = [name for name, _ in CATEGORIES] + ["other"]
    head = ["kernels", "compile", "optimizer", "step ms", "GPU ms", "kernels/step", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        cells = [
            r["kernels"],
            r["compile"],
            r["optimizer"],
            f"{r['step_ms']:.1f}",
            f"{r['gpu_ms']:.1f}",
            f"{r['kernels_per_step']:.0f}",
        ]
        cells += [f"{r['gpu_ms_by_category'].get(n, 0.0):.2f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="blocks of the xl width (default 12; xl has 48)")
    p.add_argument("--kernels", default="torch,fastlm", help="comma list (default torch,fastlm)")
    p.add_argument("--compile", default="compile,cudagraphs", help="comma list (default compile,cudagraphs)")
    p.add_argument("--optimizer", default="torch", help="comma list of torch, fastlm (AdamW; default torch)")
    p.add_argument("--out", type=Path, default=Path("benchmarks"), help="folder for results/ (default benchmarks)")
    args = p.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, 10000, (4, 512), device="cuda")
    records = []
    for compile_mode in args.compile.split(","):
        for kernels in args.kernels.split(","):
            for optimizer in args.optimizer.split(","):
                record = with_environment(measure(kernels, compile_mode, optimizer, args.layers, tokens))
                print(f"{kernels} {compile_mode} {optimizer} AdamW: step {record['step_ms']:.1f} ms, "
                      f"GPU {record['gpu_ms']:.1f} ms", flush=True)  # fmt: skip
                records.append(record)
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    append_records(args.out / "results" / "profile_compiled_step.jsonl", records)
    print(render(records))


if __name__ == "__main__":
    main()
