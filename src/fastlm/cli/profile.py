"""`fastlm profile ...`: where time and memory go in a training step of the model."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastlm.cli import output
from fastlm.cli.arguments import (
    add_command,
    add_group,
    add_out,
    add_precision_option,
    choice_list,
    int_list,
    non_negative_int,
    positive_int,
)
from fastlm.cli.models import add_model_arguments, single_model_config
from fastlm.devices import current_device
from fastlm.model.config import ModelConfig
from fastlm.settings import FP32_WEIGHT_PRECISIONS, default_precision
from fastlm.utils.host_memory import check_fits_host
from fastlm.utils.progress import progress_steps


def run_model_profile(
    out: Path, preset: str, config: ModelConfig, *, batch, precision, warmup, steps, timing_steps
) -> Path:
    """Profile inference and a training step; write the markdown summary; returns its path."""
    from fastlm.harness.runner import write_report
    from fastlm.profile import model as model_profile

    with progress_steps(f"profiling {preset}", model_profile.PROGRESS_STEPS, "phases") as step:
        profiles, records = model_profile.run(
            config,
            preset,
            batch=batch,
            precision=precision,
            warmup=warmup,
            steps=steps,
            device=current_device(),
            out=out,
            timing_steps=timing_steps,
            progress=step,
        )
    return write_report(out / "reports" / "profile_model.md", "Model profile", model_profile.render(profiles, records))


def _check_fits_cpu(preset: str, config: ModelConfig, modes, precisions, batch: int, context_option: str) -> None:
    """On a CPU, refuse a profile whose napkin memory (`fastlm.bench.model`'s estimate of its largest
    step) does not fit the host, before building the model."""
    if current_device().type != "cpu":
        return
    from fastlm.bench.model import model_memory_estimate
    from fastlm.harness.steps import Row

    rows = [Row(mode, precision, "eager") for mode in modes for precision in precisions]
    check_fits_host(
        model_memory_estimate(config, rows, batch),
        f"the {preset} model at batch {batch} and context {config.context_length}",
        f"use a smaller --preset, --batch or {context_option}",
    )


def cmd_profile_model(args) -> None:
    if args.attention is None:
        args.attention = "naive"  # the path with per-stage ranges inside attention
    preset, config = single_model_config(args)
    args.precision = args.precision or default_precision(current_device().type == "cuda")
    _check_fits_cpu(preset, config, ("fwd", "train"), (args.precision,), args.batch, "--context")
    report = run_model_profile(
        args.out,
        preset,
        config,
        batch=args.batch,
        precision=args.precision,
        warmup=args.warmup,
        steps=args.steps,
        timing_steps=args.timing_steps,
    )
    output.show_report(report)


def cmd_profile_memory(args) -> None:
    from fastlm.harness.runner import write_report
    from fastlm.profile import memory

    preset, config = single_model_config(args)
    args.precision = args.precision or (FP32_WEIGHT_PRECISIONS if current_device().type == "cuda" else ("fp32",))
    longest = dataclasses.replace(config, context_length=max(args.contexts))
    _check_fits_cpu(preset, longest, args.mode, args.precision, args.batch, "--contexts")
    device = current_device()
    with progress_steps("memory", len(args.mode) * len(args.precision) * len(args.contexts)) as step:
        records, timelines = memory.run(
            config,
            preset,
            contexts=args.contexts,
            modes=args.mode,
            precisions=args.precision,
            batch=args.batch,
            device=device,
            out=args.out,
            progress=step,
        )
    reports = args.out / "reports"
    plot = memory.timeline_plot(
        reports / f"memory_{preset}.png", timelines, f"Active memory over one step · {preset} · batch {args.batch}"
    )
    report = write_report(reports / f"memory_{preset}.md", f"Memory of {preset}", memory.render(records, plot))
    output.console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    where = (
        "snapshots (pytorch.org/memory_viz) under " + str(args.out / "snapshots")
        if device.type == "cuda"
        else ("no allocator snapshot without a GPU")
    )
    output.console.print(f"[bold]wrote[/] {report}, {plot}, HTML timelines under {reports}; {where}")


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "profile", "where time and memory go")
    p = add_command(
        commands,
        "model",
        "kernel summary per range (forward, backward, optimizer, attention stages)",
        cmd_profile_model,
        duration=("about a minute", "under 10 minutes"),
    )
    add_model_arguments(p, single=True, attention_default="naive, whose stages get ranges of their own, any --kernels")
    # bf16 on a CPU runs several times slower than fp32 where the cores lack bf16 instructions
    add_precision_option(p, FP32_WEIGHT_PRECISIONS, note="default: bf16 on a GPU, fp32 without one")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untraced steps first")
    p.add_argument("--steps", type=positive_int, default=3, help="profiled steps per phase")
    p.add_argument(
        "--timing-steps",
        type=positive_int,
        default=10,
        help="steps per round (3 rounds) when timing the tool's own cost",
    )
    add_out(p)
    p.set_defaults(attention=None)
    p = add_command(
        commands,
        "memory",
        "allocator history, timelines and peak memory per context length",
        cmd_profile_memory,
        duration=("about 20 seconds", "under 10 minutes"),
    )
    add_model_arguments(p, gpu_preset="2.7b", single=True)
    p.add_argument("--contexts", type=int_list, default=(128, 256, 512), help="comma list of context lengths")
    p.add_argument(
        "--mode",
        type=choice_list(("fwd", "train"), "mode"),
        default=("fwd", "train"),
        help="comma list of fwd (forward pass), train (full step with AdamW)",
    )
    add_precision_option(
        p,
        FP32_WEIGHT_PRECISIONS,
        many=True,
        note=f"default: {','.join(FP32_WEIGHT_PRECISIONS)} on a GPU, fp32 without one",
    )
    add_out(p)
