"""Where the host time of the compiled training step goes, per kernel set: the Python of 20 steps
under cProfile, summed by the package that owns each function (fastlm, Inductor's runtime, Triton,
autograd, the optimizer, ...) and the functions that cost the most.

The model and step are those of benchmarks/profile_compiled_step.py (the xl width, --layers blocks,
batch 4 x 512, bf16 autocast, fused AdamW, plain torch.compile): there the fastlm-kernel step takes
2-3 ms more per 12 blocks with the same GPU time, and this says which Python takes it.

Usage: python benchmarks/profile_compiled_host.py [--layers 12] > profile_compiled_host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

import torch

from fastlm.harness.steps import Row, make_optimizer, make_step, time_steps
from fastlm.model import ModelConfig, TransformerLM
from fastlm.settings import TORCH_COMPILE_MODE

# First match wins: the path fragment of a function's file names its owner.
OWNERS = (
    ("fastlm", "/fastlm/"),
    ("inductor runtime", "torch/_inductor"),
    ("dynamo guards / frames", "torch/_dynamo"),
    ("aot autograd", "torch/_functorch"),
    ("autograd", "torch/autograd"),
    ("optimizer", "torch/optim"),
    ("triton", "/triton/"),
    ("torch other", "/torch/"),
)


def owner(filename: str) -> str:
    return next((name for name, fragment in OWNERS if fragment in filename), "builtins / other")


def profile_steps(kernels: str, layers: int, tokens: torch.Tensor, steps: int = 20) -> pstats.Stats:
    config = ModelConfig.preset("xl", num_layers=layers).with_kernels(kernels)
    with torch.device(tokens.device):
        model = TransformerLM(config)
    row = Row("train", "bf16", "compile")
    module = torch.compile(model, mode=TORCH_COMPILE_MODE["compile"])
    step = make_step(module, model, row, tokens, tokens, make_optimizer(model))
    time_steps(step, warmup=5, steps=5, device=tokens.device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    return pstats.Stats(profiler)


def report(kernels: str, stats: pstats.Stats, steps: int = 20) -> None:
    by_owner: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        by_owner[owner(filename)] += tottime
        rows.append((tottime, calls, cumtime, f"{filename.split('site-packages/')[-1]}:{line}({name})"))
    total = sum(by_owner.values())
    print(f"\n== {kernels} kernels: {1e3 * total / steps:.2f} ms of Python per step (own time, cProfile)")
    for name, seconds in sorted(by_owner.items(), key=lambda item: -item[1]):
        print(f"  {name:24s} {1e3 * seconds / steps:7.2f} ms/step")
    print("  top functions by own time (ms/step, calls/step, cumulative ms/step):")
    for tottime, calls, cumtime, where in sorted(rows, reverse=True)[:25]:
        print(f"  {1e3 * tottime / steps:7.3f} {calls / steps:7.1f} {1e3 * cumtime / steps:8.3f}  {where}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="blocks of the xl width (default 12)")
    args = p.parse_args()
    torch.manual_seed(0)
    tokens = torch.randint(0, 10000, (4, 512), device="cuda")
    for kernels in ("torch", "fastlm"):
        report(kernels, profile_steps(kernels, args.layers, tokens))
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
