"""`fastlm bench train`: the training loop of `fastlm train` once per kernel set, on the same data
from the same initial weights: wall time, steady-state tokens/s and MFU, and the loss curves.

Each kernel set first trains a few untimed steps (its compilation and the process's first-call
costs), then the timed runs follow. The runs see the same batches in the same order, so their
curves differ only by the kernels' rounding and should lie on top of each other; the times show
what the fused kernels buy in a whole training run (data loading, optimizer, evaluation and
logging included). Each run writes its log and plot to OUT/<kernels>/ (one process, fresh runs,
no checkpoints; a later comparison in the same OUT replaces them); the comparison adds
OUT/kernels.png (both curves) and appends one record per run to OUT/results/train_kernels.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import timeit
from collections.abc import Sequence
from pathlib import Path

import torch

from fastlm.train import loop
from fastlm.train.config import TrainConfig
from fastlm.train.log import loss_plot, read_log
from fastlm.utils.errors import UserError
from fastlm.utils.options import from_namespace
from fastlm.utils.records import append_records, with_environment

RESULTS_FILE = "train_kernels.jsonl"
WARMUP_STEPS = 3  # untimed steps of each kernel set before the timed runs


def compare_kernels(config: TrainConfig, kernel_sets: Sequence[str]) -> list[dict]:
    """Train once per kernel set with ``config`` (checked as `fastlm train` checks it); one record
    per run: kernels, wall_s, tokens_per_s, mfu, the last training and held-out losses, and the
    configuration. Raises UserError like `fastlm.train.loop.train`."""
    if config.parallelism.processes or config.resume:
        raise UserError(
            "the kernel benchmark trains fresh runs in one process: it takes neither --parallel nor --resume"
        )
    if len(set(kernel_sets)) < len(kernel_sets):
        raise UserError(f"--kernels {','.join(kernel_sets)} names a kernel set twice: each trains into OUT/<kernels>")
    config = config.resolved(gpu=torch.cuda.is_available())
    config.check(world=1)  # as given, before each run's own values below hide some (--checkpoint-every)
    runs = {
        kernels: dataclasses.replace(
            config, kernels=kernels, out=config.out / kernels, checkpoint_every=0, overwrite=True
        )
        for kernels in kernel_sets
    }
    for run in runs.values():
        loop.check_config(run, world=1)
    # the process's one-time costs (imports, kernel compilation and autotuning, torch.compile, the
    # allocator's growth) would otherwise all land in the first kernel set's time
    config.out.mkdir(parents=True, exist_ok=True)
    for kernels, run in runs.items():
        steps = min(WARMUP_STEPS, run.steps)
        print(f"warming up the {kernels} kernels: {steps} untimed steps", flush=True)
        with tempfile.TemporaryDirectory(dir=config.out) as scratch:
            loop.train(dataclasses.replace(run, out=Path(scratch), steps=steps, warmup=0, eval_every=0))
    logs, records = {}, []
    for kernels, run in runs.items():
        start = timeit.default_timer()
        result = loop.train(run)
        wall_s = timeit.default_timer() - start
        logs[kernels] = read_log(run.out / "log.jsonl")
        records.append(
            with_environment(
                {
                    "op": "train_kernels",
                    "kernels": kernels,
                    "wall_s": wall_s,
                    "steps": result["step"],
                    "tokens_per_s": result["tokens_per_s"],
                    "mfu": result["mfu"],
                    "peak_memory_gib": result["peak_memory_gib"],
                    "final_loss": result["losses"][-1],
                    "eval_loss": result["eval"][-1][1],
                    "config": {k: str(v) if k in ("data", "out") else v for k, v in dataclasses.asdict(run).items()},
                }
            )
        )
    append_records(config.out / "results" / RESULTS_FILE, records)
    first = records[0]
    title = f"{first['config']['preset']} on {config.data.name}, each kernel set from the same start · {first['gpu']}"
    loss_plot(config.out / "kernels.png", logs, title)
    return records


def run(args: argparse.Namespace) -> int:
    """`fastlm bench train`: print one line per kernel set; 0, or 2 after a one-line error."""
    try:
        records = compare_kernels(from_namespace(TrainConfig, args, kernels=args.kernels[0]), args.kernels)
    except UserError as error:
        print(f"{args.prog}: error: {error}", flush=True, file=sys.stderr)
        return 2
    for r in records:
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        print(
            f"{r['kernels']} kernels: {r['wall_s']:.1f} s for {r['steps']} steps, {r['tokens_per_s']:,.0f} tokens/s"
            f"{mfu}; final training loss {r['final_loss']:.4f}, held-out loss {r['eval_loss']:.4f}",
            flush=True,
        )
    print(f"wrote {args.out / 'kernels.png'} and {args.out / 'results' / RESULTS_FILE}", flush=True)
    return 0
