"""`fastlm bench allreduce | ddp`: collectives and data-parallel training, one process per rank.

NCCL with one GPU per process where there are GPUs, else gloo on the CPU. Rank 0 of the worker
processes reports progress, one plain line each (`fastlm.utils.progress.print_line`).
"""

from __future__ import annotations

import argparse

from fastlm.bench.distributed.options import DDP_OPTIMIZERS, DDP_VARIANTS, Variant, ddp_variant
from fastlm.cli import output
from fastlm.cli.arguments import (
    add_command,
    add_out,
    add_precision_option,
    choice_list,
    comma_list,
    float_list,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
)
from fastlm.devices import current_device
from fastlm.model.config import PRESETS
from fastlm.settings import FP32_WEIGHT_PRECISIONS, default_precision
from fastlm.utils.errors import UserError


def _ddp_variant(part: str) -> Variant:
    try:
        return ddp_variant(part)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_variant_list = comma_list(_ddp_variant, "variants")


def _optimizer_list(text: str) -> tuple[str, ...]:
    return () if text == "none" else choice_list(DDP_OPTIMIZERS, "optimizer")(text)


def _world_sizes(procs: tuple[int, ...], backend: str) -> list[int]:
    """The process counts of --procs that this machine runs: all of them on gloo; on NCCL those with a
    GPU per process, saying which are skipped."""
    import torch

    gpus = torch.cuda.device_count()
    worlds = [n for n in procs if backend == "gloo" or n <= gpus]
    if not worlds:
        raise UserError(f"--backend nccl needs one GPU per process; this machine has {gpus}")
    skipped = sorted(set(procs) - set(worlds))
    if skipped:
        output.console.print(f"skipping {', '.join(map(str, skipped))} processes: only {gpus} GPUs")
    return worlds


def cmd_bench_allreduce(args) -> None:
    import torch

    from fastlm.bench.distributed.allreduce import AllreduceBenchmark
    from fastlm.harness.runner import run_benchmark

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    worlds = _world_sizes(args.procs, backend)
    benchmark = AllreduceBenchmark(backend, tuple(worlds), args.sizes_mb, warmup=args.warmup, iters=args.iters)
    output.show_report(run_benchmark(benchmark, args.out, current_device()))


def cmd_bench_ddp(args) -> None:
    import torch

    from fastlm.bench.distributed.ddp import DataParallelBenchmark, Settings
    from fastlm.harness.runner import run_benchmark

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    worlds = _world_sizes(args.procs, backend)
    preset = args.preset or ("xl" if backend == "nccl" else "tiny")
    settings = Settings(
        preset=preset,
        context=args.context,
        batch=args.batch,
        vocab=args.vocab,
        precision=args.precision or default_precision(backend == "nccl"),
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        profile_steps=args.profile_steps,
        bucket_mb=args.bucket_mb,
        trace_dir=str(args.out / "traces"),
    )
    benchmark = DataParallelBenchmark(backend, tuple(worlds), settings, args.variants, args.optimizers)
    output.show_report(run_benchmark(benchmark, args.out, current_device()))


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add allreduce and ddp to the bench group's ``commands``."""
    _add_allreduce_command(commands)
    _add_ddp_command(commands)


def _add_allreduce_command(commands: argparse._SubParsersAction) -> None:
    p = add_command(
        commands,
        "allreduce",
        "all-reduce time, algbw and busbw vs size and number of processes",
        cmd_bench_allreduce,
        duration=("about 2 minutes", "under 10 minutes"),
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL with one GPU per process when there are GPUs, else gloo on CPU",
    )
    p.add_argument("--procs", type=int_list, default=(2, 4, 6), help="comma list of process counts")
    p.add_argument(
        "--sizes-mb", type=float_list, default=(1, 10, 100, 1000), help="comma list of float32 tensor sizes in MB"
    )
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed all-reduces per size")
    p.add_argument("--iters", type=positive_int, default=10, help="timed all-reduces per size")
    add_out(p)


def _add_ddp_command(commands: argparse._SubParsersAction) -> None:
    p = add_command(
        commands,
        "ddp",
        "data-parallel step time, communication overlap, optimizer-state sharding",
        cmd_bench_ddp,
        duration=(
            "about 20 minutes for --procs 2 (a variant's round about 1.5 minutes), and longer for the "
            "default 2,4: 4 processes take longer than 2 on 2 cores",
            "about 5 minutes for --procs 8 --rounds 2",
        ),
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL with a GPU per process when there are 2+ GPUs, else gloo on CPU",
    )
    p.add_argument("--procs", type=int_list, default=(2, 4), help="comma list of process counts")
    p.add_argument(
        "--preset", choices=PRESETS, default=None, help="model preset (default xl with NCCL, tiny with gloo)"
    )
    p.add_argument("--vocab", type=positive_int, default=10000, help="vocabulary size")
    p.add_argument("--context", type=positive_int, default=512, help="sequence length")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per rank")
    add_precision_option(p, FP32_WEIGHT_PRECISIONS, note="default: bf16 with NCCL, fp32 with gloo")
    p.add_argument(
        "--variants",
        type=_variant_list,
        default=",".join(DDP_VARIANTS),
        help="comma list of gradient synchronizations; bucketed-X for any X MB; any but no-sync with -bf16 "
        "appended averages in bf16",
    )
    p.add_argument(
        "--optimizers",
        type=_optimizer_list,
        default=DDP_OPTIMIZERS,
        help="memory rows: comma list of adamw, sharded (ShardedOptimizer), zero (ZeroRedundancyOptimizer), or none",
    )
    p.add_argument("--bucket-mb", type=positive_float, default=25.0, help="BucketedDDP bucket size of the memory rows")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps per variant and round")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per variant and round")
    p.add_argument(
        "--rounds", type=positive_int, default=2, help="passes over the variants, fresh models each; timings are pooled"
    )
    p.add_argument("--profile-steps", type=positive_int, default=2, help="profiled steps per variant")
    add_out(p)
