"""`fastlm <group> <command>`: benchmarks, cost models, inspection and the main report.

User mistakes (bad flag values, unknown GPU, a GPU-only command without a GPU) end with one
clear sentence and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fastlm.devices import DEVICES, device_spec
from fastlm.model.config import ATTENTION_KERNELS, LOSS_KERNELS, NORM_KERNELS, PRESETS, SOFTMAX_KERNELS, ModelConfig

console = Console()


class UserError(Exception):
    """A mistake in how fastlm was called; printed as one sentence."""


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )


def _write_report(path: Path, title: str, body: str) -> Path:
    """A markdown report: ``# title``, then ``body``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{body}\n")
    return path


def _show_report(report: Path) -> None:
    """Print a written report and where it is."""
    console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote[/] {report}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    return _positive_int(text)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(","))


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------


def cmd_bench_ceilings(args) -> None:
    from fastlm.bench.ceilings import record_ceilings

    record = record_ceilings(args.out / "results", _device())
    table = Table(title=f"Measured ceilings · {record['gpu']}")
    for column in ("copy GB/s", "matmul TFLOP/s", "matmul", "% of datasheet (copy / matmul)"):
        table.add_column(column)
    datasheet = "—"
    if "copy_fraction_of_datasheet" in record:
        datasheet = (
            f"{100 * record['copy_fraction_of_datasheet']:.0f}% / {100 * record['matmul_fraction_of_datasheet']:.0f}%"
        )
    shape = "x".join(map(str, record["matmul_shape"]))
    table.add_row(
        f"{record['copy_gbps']:.0f}", f"{record['matmul_tflops']:.1f}", f"{shape} {record['matmul_dtype']}", datasheet
    )
    console.print(table)


def run_xent_benchmark(out: Path, batch: int | None, vocabs: tuple[int, ...] | None) -> Path:
    """Ceilings, then the cross-entropy sweep, then its markdown report; returns the report path."""
    from fastlm.bench import xent
    from fastlm.bench.ceilings import record_ceilings

    device = _device()
    if batch is None:
        batch = xent.DEFAULT_BATCH if device.type == "cuda" else xent.CPU_BATCH
    vocabs = vocabs or xent.DEFAULT_VOCABS
    results_dir, reports_dir = out / "results", out / "reports"
    ceilings = record_ceilings(results_dir, device)
    with _progress() as progress:
        task = progress.add_task("cross-entropy", total=len(vocabs) * len(xent.IMPLEMENTATIONS))

        def step(done: str) -> None:
            progress.update(task, description=f"cross-entropy (done: {done})", advance=1)

        xent.run(batch=batch, vocabs=vocabs, device=device, ceilings=ceilings, results_dir=results_dir, progress=step)
    report = _write_report(reports_dir / "xent.md", "Cross-entropy benchmark", xent.render(results_dir, reports_dir))
    return report


def cmd_bench_xent(args) -> None:
    report = run_xent_benchmark(args.out, args.batch, args.vocab)
    _show_report(report)


def run_bandwidth_benchmark(out: Path, module, name: str, title: str) -> Path:
    """`bench norms | softmax | conv1d`: copy ceiling, every case x implementation; the report's path."""
    from fastlm.bench.ceilings import record_ceilings

    device = _device()
    results_dir, reports_dir = out / "results", out / "reports"
    ceilings = record_ceilings(results_dir, device)
    with _progress() as progress:
        task = progress.add_task(name, total=len(module.cases(device)) * len(module.IMPLEMENTATIONS))

        def step(done: str) -> None:
            progress.update(task, description=f"{name} (done: {done})", advance=1)

        module.run(device, ceilings, results_dir, progress=step)
    return _write_report(reports_dir / f"{name}.md", title, module.render(results_dir, reports_dir))


def cmd_bench_norms(args) -> None:
    from fastlm.bench import norms

    _show_report(run_bandwidth_benchmark(args.out, norms, "norms", "LayerNorm / RMSNorm benchmark"))


def cmd_bench_softmax(args) -> None:
    from fastlm.bench import softmax

    _show_report(run_bandwidth_benchmark(args.out, softmax, "softmax", "Masked softmax benchmark"))


def run_roofline(out: Path) -> Path:
    """The roofline report from the results under ``out``, with this device's latest ceilings."""
    from fastlm.bench import roofline
    from fastlm.bench.ceilings import RESULTS_FILE, record_ceilings
    from fastlm.bench.records import read_records
    from fastlm.devices import current_device_name

    results_dir, reports_dir = out / "results", out / "reports"
    here = [r for r in read_records(results_dir / RESULTS_FILE) if r["gpu"] == current_device_name()]
    ceilings = here[-1] if here else record_ceilings(results_dir, _device())  # the kernels' own run's ceilings
    return _write_report(reports_dir / "roofline.md", "Roofline", roofline.render(results_dir, reports_dir, ceilings))


def cmd_bench_roofline(args) -> None:
    _show_report(run_roofline(args.out))


def cmd_bench_conv1d(args) -> None:
    from fastlm.bench import conv1d

    _show_report(run_bandwidth_benchmark(args.out, conv1d, "conv1d", "Causal conv1d benchmark"))


def cmd_bench_linear_xent(args) -> None:
    from fastlm.bench import linear_xent

    title = "Fused linear + cross-entropy benchmark"
    _show_report(run_bandwidth_benchmark(args.out, linear_xent, "linear_xent", title))


@contextlib.contextmanager
def _steps(name: str, total: int):
    """Yields ``step(done)`` for a long run: a progress bar on a terminal; one plain line per step when
    the output is piped or logged (where a bar would show only once, at the end)."""
    if console.is_terminal:
        with _progress() as progress:
            task = progress.add_task(name, total=total)
            yield lambda done: progress.update(task, description=f"{name} (done: {done})", advance=1)
        return
    count = 0

    def step(done: str) -> None:
        nonlocal count
        count += 1
        console.print(f"{name} {count}/{total}: {done}", markup=False, highlight=False)

    yield step


def _host_ops(text: str) -> tuple[str, ...]:
    from fastlm.bench.host import OPS  # imported on use: it loads torch and the kernels

    return _choice_list(OPS, "op")(text)


def _rounds(text: str) -> int:
    from fastlm.bench.host import MIN_ROUNDS

    value = _positive_int(text)
    if value < MIN_ROUNDS:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_ROUNDS} rounds (a median and a spread), got {value}")
    return value


def run_host_benchmark(
    out: Path, ops: Sequence[str] | None, modes: Sequence[str], rounds: int | None, calls: int | None
) -> Path:
    """Host cost per call of each op vs its PyTorch op (`fastlm.bench.host`); returns the report path.
    ``None`` picks all ops, and the rounds and calls of this device (fewer on CPU)."""
    from fastlm.bench import host

    device = _device()
    on_gpu = device.type == "cuda"
    cases = [host.CASES[name] for name in (ops or host.OPS)]
    if not on_gpu:
        console.print(host.CPU_NOTE)
    with _steps("host cost", len(cases) * len(modes)) as step:
        host.run(cases, modes, device, out / "results", progress=step,
                 rounds=rounds or (host.GPU_ROUNDS if on_gpu else host.CPU_ROUNDS),
                 calls=calls or (host.GPU_CALLS if on_gpu else host.CPU_CALLS),
                 warmup=host.GPU_WARMUP if on_gpu else host.CPU_WARMUP)  # fmt: skip
    body = host.render(out / "results", out / "reports")
    return _write_report(out / "reports" / "host.md", "Host cost per call: fastlm vs PyTorch", body)


def cmd_bench_host(args) -> None:
    _show_report(run_host_benchmark(args.out, args.ops, args.compile, args.rounds, args.calls))


def _sweep_list(text: str) -> tuple[str, ...]:
    from fastlm.bench.attention import SWEEPS  # imported on use: it loads torch and the kernels

    return _choice_list(SWEEPS, "sweep")(text)


def run_attention_benchmark(out: Path, sweeps: tuple[str, ...]) -> Path:
    """The attention sweeps, then their markdown report; returns the report path."""
    from fastlm.bench import attention

    device = _device()
    results_dir, reports_dir = out / "results", out / "reports"
    with _progress() as progress:
        task = progress.add_task("attention", total=attention.total_measurements(sweeps, device))

        def step(done: str) -> None:
            progress.update(task, description=f"attention (done: {done})", advance=1)

        attention.run(sweeps, device, results_dir, progress=step)
    return _write_report(
        reports_dir / "attention.md", "Attention benchmark", attention.render(results_dir, reports_dir)
    )


def cmd_bench_attention(args) -> None:
    report = run_attention_benchmark(args.out, args.sweep)
    _show_report(report)


def _choice_list(choices: Sequence[str], what: str = "value"):
    """argparse type: a comma-separated subset of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip() for part in text.split(","))
        unknown = [v for v in values if v not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(choices)}")
        return values

    return parse


def model_configs(args) -> list[tuple[str, ModelConfig]]:
    """(name, config) for every preset x kernel set named on the command line; explicit
    --d-model/--d-ff/--layers/--heads build one "custom" config instead of presets."""
    import dataclasses

    common = {"vocab_size": args.vocab, "context_length": args.context}
    dims = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads}
    if any(v is not None for v in dims.values()):
        missing = [f"--{k.replace('num_', '').replace('_', '-')}" for k, v in dims.items() if v is None]
        if missing:
            raise UserError(
                f"a custom model needs --d-model, --d-ff, --layers and --heads; missing {', '.join(missing)}"
            )
        bases = [("custom", lambda: ModelConfig(**dims, **common))]
    else:
        presets = args.preset or ((args.gpu_preset,) if _device().type == "cuda" else ("tiny",))
        bases = [(name, lambda name=name: ModelConfig.preset(name, **common)) for name in presets]
    overrides = {k: getattr(args, k) for k in ("attention", "norm", "loss", "softmax") if getattr(args, k) is not None}
    configs = []
    for name, make in bases:
        for kernels in args.kernels:
            try:
                configs.append((name, dataclasses.replace(make().with_kernels(kernels), **overrides)))
            except ValueError as error:
                raise UserError(str(error)) from None
    return configs


def run_model_benchmark(
    out: Path, configs, rows, *, batch: int, warmup: int, steps: int, hf: bool, rounds: int = 1,
    interleave: bool | None = None,
) -> Path:  # fmt: skip
    """Measure the model rows for ``rounds`` rounds (interleaved across configurations unless
    ``interleave`` is False, or None and the models would not fit in memory together), then write
    their markdown report; returns the report path."""
    from fastlm.bench import model as model_bench

    device = _device()
    implementations = model_bench.IMPLEMENTATIONS if hf else ("fastlm",)
    if hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--hf needs the transformers package: pip install transformers") from None
    results_dir, reports_dir = out / "results", out / "reports"
    with _progress() as progress:
        subjects = model_bench.subjects(configs, implementations)
        task = progress.add_task("model", total=len(subjects) * len(rows) * rounds)

        def step(done: str) -> None:
            progress.update(task, description=f"model (done: {done})", advance=1)

        model_bench.run(configs, rows, batch=batch, warmup=warmup, steps=steps, device=device,
                        results_dir=results_dir, implementations=implementations, rounds=rounds,
                        interleave=interleave, progress=step)  # fmt: skip
    report = _write_report(reports_dir / "model.md", "Model benchmark", model_bench.render(results_dir, reports_dir))
    return report


def cmd_bench_model(args) -> None:
    from fastlm.analysis.model import MODES
    from fastlm.bench.model import PRECISIONS, SWEEP_COMPILE_MODES, rows
    from fastlm.model.config import PRESETS

    if args.sweep:
        args.preset = args.preset or tuple(p for p in PRESETS if p != "tiny")
        args.mode, args.precision, args.compile = (
            args.mode or MODES,
            args.precision or PRECISIONS,
            args.compile or SWEEP_COMPILE_MODES,
        )
    row_list = rows(args.mode or ("train",), args.precision or ("bf16",), args.compile or ("eager",))
    report = run_model_benchmark(args.out, model_configs(args), row_list, batch=args.batch, warmup=args.warmup,
                                 steps=args.steps, hf=args.hf, rounds=args.rounds,
                                 interleave=args.interleave)  # fmt: skip
    _show_report(report)


def cmd_bench_allreduce(args) -> None:
    import torch

    from fastlm.distributed import allreduce_bench

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < min(args.procs):
        raise UserError(f"NCCL needs one GPU per process; this machine has {torch.cuda.device_count()}")
    worlds = [n for n in args.procs if backend == "gloo" or n <= torch.cuda.device_count()]
    skipped = sorted(set(args.procs) - set(worlds))
    if skipped:
        console.print(f"skipping {', '.join(map(str, skipped))} processes: only {torch.cuda.device_count()} GPUs")
    results_dir, reports_dir = args.out / "results", args.out / "reports"
    with _progress() as progress:
        task = progress.add_task(f"all-reduce ({backend})", total=len(worlds))

        def step(done: str) -> None:
            progress.update(task, advance=1, description=f"all-reduce ({backend}, done: {done})")

        allreduce_bench.run(backend, worlds, args.sizes_mb, results_dir, warmup=args.warmup, iters=args.iters,
                            progress=step)  # fmt: skip
    report = _write_report(
        reports_dir / "allreduce.md", "All-reduce benchmark", allreduce_bench.render(results_dir, reports_dir)
    )
    _show_report(report)


def cmd_bench_ddp(args) -> None:
    import torch

    from fastlm.distributed import ddp_bench

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    worlds = [n for n in args.procs if backend == "gloo" or n <= torch.cuda.device_count()]
    if not worlds:
        raise UserError(f"NCCL needs one GPU per process; this machine has {torch.cuda.device_count()}")
    skipped = sorted(set(args.procs) - set(worlds))
    if skipped:
        console.print(f"skipping {', '.join(map(str, skipped))} processes: only {torch.cuda.device_count()} GPUs")
    preset = args.preset or ("xl" if backend == "nccl" else "tiny")
    settings = ddp_bench.Settings(
        preset=preset, context=args.context, batch=args.batch, vocab=args.vocab, precision=args.precision,
        warmup=args.warmup, steps=args.steps, rounds=args.rounds, profile_steps=args.profile_steps,
        bucket_mb=args.bucket_mb,
        trace_dir=str(args.out / "traces"),
    )  # fmt: skip
    results_dir, reports_dir = args.out / "results", args.out / "reports"
    with _progress() as progress:
        task = progress.add_task(f"data-parallel steps ({backend}, {preset})", total=len(worlds))

        def step(done: str) -> None:
            progress.update(task, advance=1, description=f"data-parallel steps ({backend}, done: {done})")

        ddp_bench.run(backend, worlds, settings, args.variants, args.optimizers, results_dir, progress=step)
    report = _write_report(
        reports_dir / "ddp.md", "Data-parallel training benchmark", ddp_bench.render(results_dir, reports_dir)
    )
    _show_report(report)


def _variant_list(text: str) -> tuple[str, ...]:
    from fastlm.distributed.ddp_bench import check_variant

    try:
        return tuple(check_variant(part.strip()) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _optimizer_list(text: str) -> tuple[str, ...]:
    from fastlm.distributed.ddp_bench import OPTIMIZERS

    return () if text == "none" else _choice_list(OPTIMIZERS, "optimizer")(text)


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return values


# ---------------------------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------------------------


def _single_model_config(args) -> tuple[str, ModelConfig]:
    configs = model_configs(args)
    if len(configs) != 1:
        raise UserError(f"{args.group} {args.command} takes one model; got {len(configs)} (presets x kernels)")
    return configs[0]


def run_model_profile(
    out: Path, preset: str, config: ModelConfig, *, batch, precision, warmup, steps, timing_steps
) -> Path:
    """Profile inference and a training step; write the markdown summary; returns its path."""
    from fastlm.profile import model as model_profile

    with console.status(f"profiling {preset} (inference, then a training step)"):
        profiles, records = model_profile.run(config, preset, batch=batch, precision=precision, warmup=warmup,
                                              steps=steps, device=_device(), out=out,
                                              timing_steps=timing_steps)  # fmt: skip
    return _write_report(out / "reports" / "profile_model.md", "Model profile", model_profile.render(profiles, records))


def cmd_profile_model(args) -> None:
    if args.attention is None:
        args.attention = "naive"  # the path with per-stage ranges inside attention
    preset, config = _single_model_config(args)
    report = run_model_profile(args.out, preset, config, batch=args.batch, precision=args.precision,
                               warmup=args.warmup, steps=args.steps, timing_steps=args.timing_steps)  # fmt: skip
    _show_report(report)


def cmd_profile_memory(args) -> None:
    from fastlm.profile import memory

    preset, config = _single_model_config(args)
    device = _device()
    with _progress() as progress:
        task = progress.add_task("memory", total=len(args.mode) * len(args.precision) * len(args.contexts))

        def step(done: str) -> None:
            progress.update(task, description=f"memory (done: {done})", advance=1)

        records, timelines = memory.run(config, preset, contexts=args.contexts, modes=args.mode,
                                        precisions=args.precision, batch=args.batch, device=device, out=args.out,
                                        progress=step)  # fmt: skip
    reports = args.out / "reports"
    plot = memory.timeline_plot(reports / f"memory_{preset}.png", timelines,
                                f"Active memory over one step · {preset} · batch {args.batch}")  # fmt: skip
    report = _write_report(reports / f"memory_{preset}.md", f"Memory of {preset}", memory.render(records, plot))
    console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    where = (
        "snapshots (pytorch.org/memory_viz) under " + str(args.out / "snapshots")
        if device.type == "cuda"
        else ("no allocator snapshot without a GPU")
    )
    console.print(f"[bold]wrote[/] {report}, {plot}, HTML timelines under {reports}; {where}")


# ---------------------------------------------------------------------------------------------
# analyze
# ---------------------------------------------------------------------------------------------


def cmd_analyze_xent(args) -> None:
    from fastlm.analysis.xent import FORMULAS, CrossEntropyCost

    spec = device_spec(args.gpu)
    cost = CrossEntropyCost(args.batch, args.vocab)
    fwd, bwd = cost.fwd_bound(spec), cost.bwd_bound(spec)
    table = Table(title=f"Cross-entropy cost model · B={args.batch}, V={args.vocab} · {spec.name}")
    table.add_column("quantity")
    table.add_column("formula")
    table.add_column("forward", justify="right")
    table.add_column("backward", justify="right")
    gb = lambda n: f"{n / 1e9:.4f} GB ({n:,} B)"
    table.add_row("bytes loaded", f"{FORMULAS['fwd loaded']} | {FORMULAS['bwd loaded']}",
                  gb(cost.fwd_bytes_loaded), gb(cost.bwd_bytes_loaded))  # fmt: skip
    table.add_row("bytes stored", f"{FORMULAS['fwd stored']} | {FORMULAS['bwd stored']}",
                  gb(cost.fwd_bytes_stored), gb(cost.bwd_bytes_stored))  # fmt: skip
    table.add_row("FLOPs per token", f"{FORMULAS['fwd FLOPs/token']} | {FORMULAS['bwd FLOPs/token']}",
                  f"{cost.fwd_flops_per_token:,}", f"{cost.bwd_flops_per_token:,}")  # fmt: skip
    table.add_row("FLOPs", "B x per token", f"{cost.fwd_flops:,}", f"{cost.bwd_flops:,}")
    table.add_row("arithmetic intensity", "FLOPs / bytes", f"{fwd.intensity:.3f} FLOP/B", f"{bwd.intensity:.3f} FLOP/B")
    table.add_row("device ridge (CUDA cores fp32)", f"{spec.vector_fp32_tflops} TF / {spec.memory_gbps:.0f} GB/s",
                  f"{fwd.ridge:.1f} FLOP/B", f"{bwd.ridge:.1f} FLOP/B")  # fmt: skip
    tensor_rate = f"{spec.matmul_tflops} TF {spec.matmul_dtype} / {spec.memory_gbps:.0f} GB/s"
    table.add_row("device ridge (tensor cores)", tensor_rate,
                  f"{spec.ridge_flops_per_byte:.0f} FLOP/B", f"{spec.ridge_flops_per_byte:.0f} FLOP/B")  # fmt: skip
    table.add_row("verdict", "intensity vs ridge", fwd.verdict, bwd.verdict)
    table.add_row(
        "minimum time", "max(bytes/BW, FLOPs/rate)", f"{fwd.min_time_s * 1e6:.1f} µs", f"{bwd.min_time_s * 1e6:.1f} µs"
    )
    console.print(table)
    fused = cost.fused_bound(spec)
    console.print(
        f"Fused training pass (loss + dlogits in one kernel): {gb(cost.fused_bytes)}, "
        f"minimum {fused.min_time_s * 1e6:.1f} µs vs {(fwd.min_time_s + bwd.min_time_s) * 1e6:.1f} µs "
        "for forward + backward."
    )


def cmd_analyze_conv1d(args) -> None:
    from fastlm.analysis.conv1d import FORMULAS, Conv1dCost

    spec = device_spec(args.gpu)
    sizes = {"fp32": 4, "fp16": 2, "bf16": 2}
    cost = Conv1dCost(args.batch, args.length, args.channels, args.kernel_size, sizes[args.dtype],
                      bias=not args.no_bias, silu=args.activation == "silu")  # fmt: skip
    fused, padded = cost.fwd_bound(spec), cost.fwd_bound(spec, padding_pass=True)
    table = Table(title=f"Causal conv1d forward · B={args.batch}, L={args.length}, D={args.channels}, "
                        f"K={args.kernel_size}, {args.dtype} · {spec.name}")  # fmt: skip
    table.add_column("quantity")
    table.add_column("formula")
    table.add_column("fused (masked loads)", justify="right")
    table.add_column("separate padding pass", justify="right")
    table.add_row("bytes", f"{FORMULAS['fused']} | {FORMULAS['padding pass']}",
                  f"{fused.bytes / 1e6:,.1f} MB", f"{padded.bytes / 1e6:,.1f} MB")  # fmt: skip
    table.add_row("FLOPs", FORMULAS["FLOPs"], f"{fused.flops:,}", f"{padded.flops:,}")
    table.add_row("arithmetic intensity", "FLOPs / bytes", f"{fused.intensity:.2f} FLOP/B",
                  f"{padded.intensity:.2f} FLOP/B")  # fmt: skip
    ridge = f"{spec.vector_fp32_tflops} TF / {spec.memory_gbps:.0f} GB/s"
    table.add_row("device ridge (CUDA cores fp32)", ridge, f"{fused.ridge:.1f} FLOP/B", f"{padded.ridge:.1f} FLOP/B")
    table.add_row("verdict", "intensity vs ridge", fused.verdict, padded.verdict)
    table.add_row("minimum time", "max(bytes/BW, FLOPs/rate)", f"{fused.min_time_s * 1e6:.1f} µs",
                  f"{padded.min_time_s * 1e6:.1f} µs")  # fmt: skip
    console.print(table)
    console.print(f"Backward (fused, z recomputed): {cost.bwd_bytes / 1e6:,.1f} MB, at least "
                  f"{cost.bwd_bytes / (spec.memory_gbps * 1e9) * 1e6:.1f} µs. The conv sits far left of the ridge "
                  "on the roofline: its floor is bytes / bandwidth, so the fused kernel's target is the copy "
                  "bandwidth.")  # fmt: skip


def cmd_analyze_memory(args) -> None:
    from fastlm.analysis.model import TrainingMemory

    preset, config = _single_model_config(args)
    gib = lambda n: f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
    memory = TrainingMemory(config, args.batch, max(args.contexts))
    table = Table(title=f"Training memory · {preset} · {config.num_parameters():,} parameters · batch {args.batch}")
    table.add_column("what")
    table.add_column("formula")
    table.add_column("bytes", justify="right")
    table.add_row("parameters (fp32)", "4 x N", gib(memory.parameters))
    table.add_row("gradients (fp32)", "4 x N", gib(memory.gradients))
    table.add_row("AdamW state (fp32 m and v)", "8 x N", gib(memory.adamw_state))
    table.add_row("total before activations", "16 x N", gib(memory.static))
    for context in args.contexts:
        one = TrainingMemory(config, args.batch, context)
        table.add_row(f"one residual-stream activation, context {context}", "batch x context x d_model x bytes",
                      f"{gib(one.residual_activation(4))} fp32 / {gib(one.residual_activation(2))} bf16")  # fmt: skip
    console.print(table)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def cmd_analyze_parallel(args) -> None:
    """`analyze parallel`: memory, GPUs, FSDP degree and compute-bound batch of a stack of MLP blocks."""
    import math

    from fastlm.analysis import parallel as cost

    try:
        config = cost.ParallelConfig(d_model=args.d_model, d_ff=args.d_ff, blocks=args.blocks, batch=args.batch,
                                     context_length=args.context)  # fmt: skip
        mesh = cost.MeshConfig(w_ici=args.w_ici, flops=args.flops, m_x=args.mx, m_y=args.my, x=args.x, y=args.y)
    except ValueError as error:
        raise UserError(str(error)) from None
    gb = lambda n: f"{n / cost.GB:,.2f} GB"
    gib = lambda n: f"{n / 2**30:,.2f} GiB"
    memory = cost.memory_accounting(config)
    table = Table(title=f"Training memory · d_model {config.d_model}, d_ff {config.d_ff}, {config.blocks} blocks of "
                        f"two linear layers · {config.tokens:,} tokens (batch {config.batch} x context "
                        f"{config.context_length}) · 1 GB = 1e9 bytes, 1 GiB = 2^30")  # fmt: skip
    table.add_column("what")
    table.add_column("formula")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_row("parameters P", "2 x blocks x d_model x d_ff", f"{memory.parameters:,}", "")
    for what, formula, n_bytes in (("master weights (fp32)", "4 x P", memory.master_weights),
                                   ("accumulated gradients (fp32)", "4 x P", memory.gradients),
                                   ("AdamW state (fp32 m and v)", "8 x P", memory.adamw_state),
                                   ("weights + gradients + AdamW", "16 x P", memory.state)):  # fmt: skip
        table.add_row(what, formula, gb(n_bytes), gib(n_bytes))
    table.add_row("saved activations per token (bf16)", "2 x blocks x (d_model + d_ff)",
                  f"{memory.activations_per_token:,} B", "")  # fmt: skip
    table.add_row(f"saved activations A, {config.tokens:,} tokens", "tokens x per token", gb(memory.activations),
                  gib(memory.activations))  # fmt: skip
    table.add_row("total", "16 x P + A", gb(memory.total), gib(memory.total))
    gpu = f"{args.gpu_memory_gb:g} GB"
    gpus = [cost.devices_needed(n_bytes, args.gpu_memory_gb) for n_bytes in (memory.state, memory.total)]
    table.add_row(f"{gpu} GPUs for 16 x P", f"ceil(16 x P / {gpu})", str(gpus[0]), "")
    table.add_row(f"{gpu} GPUs for 16 x P + A", f"ceil((16 x P + A) / {gpu})", str(gpus[1]), "")
    console.print(table)
    console.print(f"{gpu} GPUs to hold it: [bold]{gpus[0]}[/] for weights, gradients and AdamW state, "
                  f"[bold]{gpus[1]}[/] with the saved activations too.")  # fmt: skip

    limit_gb = args.device_memory_gb
    n_min = cost.smallest_fsdp_degree(config, limit_gb)
    half = memory.activations / 2
    fsdp = Table(title=f"FSDP over N devices: 16 x P and A/2 sharded, the other A/2 on every device · "
                       f"per device (16 x P + A/2) / N + A/2 · limit {limit_gb:g} GB")  # fmt: skip
    fsdp.add_column("N", justify="right", no_wrap=True)
    fsdp.add_column("(16 x P + A/2) / N", justify="right", no_wrap=True)
    fsdp.add_column("A/2", justify="right", no_wrap=True)
    fsdp.add_column("per device", justify="right", no_wrap=True)
    fsdp.add_column("GiB", justify="right", no_wrap=True)
    fsdp.add_column(f"< {limit_gb:g} GB", no_wrap=True)
    shown = sorted({1, 8, 64} | ({n_min - 1, n_min} - {0} if n_min else set()))
    for n in shown:
        per_device = cost.fsdp_memory_per_device(config, n)
        fsdp.add_row(str(n), gb(per_device - half), gb(half), gb(per_device), gib(per_device),
                     "yes" if per_device < limit_gb * cost.GB else "no")  # fmt: skip
    console.print(fsdp)
    if n_min is None:
        console.print(f"No N_FSDP fits under {limit_gb:g} GB: the replicated half of the activations alone, "
                      f"A/2 = {gb(half)}, does not; save fewer tokens (--batch, --context).")  # fmt: skip
    else:
        per_device = cost.fsdp_memory_per_device(config, n_min)
        console.print(f"Smallest N_FSDP with per-device memory under {limit_gb:g} GB: [bold]{n_min}[/] "
                      f"({gb(per_device)} = {gib(per_device)} per device).")  # fmt: skip

    batch = cost.compute_bound_batch(config, mesh)
    n_devices = mesh.devices
    title = (f"Forward pass, FSDP x TP · X = {mesh.x} (FSDP, M_X = {mesh.m_x}) x Y = {mesh.y} (TP, M_Y = {mesh.m_y}) "
             f"= {n_devices} chips · C = {mesh.flops:.3g} FLOP/s, W_ici = {mesh.w_ici:.3g} B/s")  # fmt: skip
    if batch is None:
        console.print(f"[bold]{title}[/]")
        alpha = mesh.ici_intensity
        console.print(f"No batch is compute-bound: the TP collectives alone take as long as the math, since d_ff = "
                      f"{config.d_ff} <= alpha x Y / M_Y = {alpha * mesh.y / mesh.m_y:,.1f} "
                      f"(alpha = C / W_ici = {alpha:,.1f}); use a smaller --y or a larger --my.")  # fmt: skip
        return
    times = cost.forward_times(config, mesh, batch)
    per_device = math.ceil(batch / n_devices)
    forward = Table(title=title)
    forward.add_column("quantity")
    forward.add_column("formula")
    forward.add_column("value", justify="right", no_wrap=True)
    us = lambda seconds: f"{seconds * 1e6:,.1f} µs"
    forward.add_row("alpha, ICI FLOPs per byte", "C / W_ici", f"{mesh.ici_intensity:,.1f} FLOP/B")
    forward.add_row("smallest compute-bound batch B", "alpha F X / (M_X (F - alpha Y / M_Y))",
                    f"{batch:,.1f} tokens")  # fmt: skip
    forward.add_row("per-device batch", "B / N", f"{batch / n_devices:,.1f} tokens")
    forward.add_row("smallest whole per-device batch", "ceil(B / N), total x N",
                    f"{per_device:,} ({per_device * n_devices:,} in all)")  # fmt: skip
    forward.add_row("T_math per block at B", "4 B D F / (N C)", us(times.math_s))
    forward.add_row("T_FSDP: AllGather weights on X", "4 D F / (Y W_ici M_X)", us(times.fsdp_comms_s))
    forward.add_row("T_TP: In and Out collectives on Y", "4 B D / (X W_ici M_Y)", us(times.tp_comms_s))
    console.print(forward)
    console.print("Compute-bound when T_math >= T_FSDP + T_TP (communication overlapped with math; How to Scale "
                  "Your Model, 'Mixed FSDP and Tensor Parallelism'); the times are per block and the same ratio holds "
                  "for all blocks. Assumptions: fastlm.analysis.parallel, docs/distributed.md.")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# train, ar
# ---------------------------------------------------------------------------------------------


def _recall_config(args):
    from fastlm.tasks.associative_recall import RecallConfig

    try:
        return RecallConfig(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                            num_train=args.train, num_test=args.test, seed=args.seed)  # fmt: skip
    except ValueError as error:
        raise UserError(str(error)) from None


def cmd_train_lm(args) -> None:
    from fastlm.bench.records import append_records, with_environment
    from fastlm.tasks.text_training import TextSettings, load_corpus, loss_plot, split_windows, train_kernels

    device = _device()
    settings = TextSettings(preset=args.preset or ("small" if device.type == "cuda" else "tiny"),
                            context=args.context, batch=args.batch, epochs=args.epochs, lr=args.lr,
                            precision=args.precision or ("bf16" if device.type == "cuda" else "fp32"),
                            seed=args.seed, compile=args.compile)  # fmt: skip
    try:
        windows = split_windows(load_corpus(args.data), settings.context)
    except (OSError, ValueError) as error:
        raise UserError(str(error)) from None
    steps = settings.epochs * -(-windows[0].shape[0] // settings.batch)
    runs = []
    with _progress() as progress:
        for kernels in args.kernels:
            bar = progress.add_task(f"{kernels} kernels", total=steps)

            def step(done: int, loss, bar=bar) -> None:  # the loss is not read here: that would synchronize
                progress.update(bar, completed=done)

            runs.append(train_kernels(windows, kernels, settings, device, on_step=step))
    records = [with_environment({"task": "text", "data": str(args.data), "corpus_bytes": args.data.stat().st_size,
                                 **settings.__dict__, **run}) for run in runs]  # fmt: skip
    append_records(args.out / "results" / "text_training.jsonl", records)
    title = (f"{settings.preset} on {args.data.name} ({records[0]['corpus_bytes']:,} bytes), context "
             f"{settings.context}, batch {settings.batch}, {settings.precision}, {settings.compile} · "
             f"{records[0]['gpu']}")  # fmt: skip
    plot = loss_plot(args.out / "reports" / "text_training.png", runs, title)
    table = Table(title=f"Byte-level LM, {settings.epochs} epoch(s) per kernel set")
    for column in ("kernels", "epoch time", "tokens/s", "final train loss", "held-out loss"):
        table.add_column(column)
    for run in runs:
        epoch = sum(run["epoch_seconds"]) / len(run["epoch_seconds"])
        table.add_row(run["kernels"], f"{epoch:.2f} s", f"{run['tokens_per_s']:,.0f}", f"{run['losses'][-1]:.4f}",
                      f"{run['held_out_loss']:.4f}")  # fmt: skip
    console.print(table)
    console.print(f"[bold]wrote[/] {plot}")


def cmd_train_ar(args) -> None:
    from fastlm.bench.records import append_records, with_environment
    from fastlm.tasks.associative_recall import make_splits
    from fastlm.tasks.recall_training import TARGET_ACCURACY, TrainSettings, accuracy_plot, minimum_layers, train_depth

    task = _recall_config(args)
    settings = TrainSettings(d_model=args.d_model, num_heads=args.heads, epochs=args.epochs, batch=args.batch,
                             lr=args.lr, seed=args.seed)  # fmt: skip
    if settings.d_model % settings.num_heads:
        raise UserError(f"--d-model ({settings.d_model}) must be divisible by --heads ({settings.num_heads})")
    splits = make_splits(task)
    rows = []
    with _progress() as progress:
        for layers in args.layers:
            bar = progress.add_task(f"{layers} layer(s)", total=settings.epochs)

            def step(row: dict, bar=bar, layers=layers) -> None:
                progress.update(bar, advance=1, description=f"{layers} layer(s): test accuracy "
                                f"{100 * row['test_accuracy']:.1f}% (loss {row['train_loss']:.3f})")  # fmt: skip

            rows += train_depth(task, splits, layers, settings, on_epoch=step)
    records = [with_environment({"task": "associative_recall", **task.__dict__, **settings.__dict__, **row})
               for row in rows]  # fmt: skip
    append_records(args.out / "results" / "associative_recall.jsonl", records)
    plot = accuracy_plot(args.out / "reports" / "associative_recall.png", rows,
                         f"Associative recall: {task.num_pairs} pairs, {task.num_keys} keys, {task.num_values} values, "
                         f"{task.num_train} training sequences")  # fmt: skip
    table = Table(title="Test accuracy by depth")
    for column in ("layers", "best", "epoch of best", "first epoch >= 90%", "final"):
        table.add_column(column)
    for layers in args.layers:
        mine = [r for r in rows if r["layers"] == layers]
        best = max(mine, key=lambda r: r["test_accuracy"])
        first = next((r["epoch"] for r in mine if r["test_accuracy"] >= TARGET_ACCURACY), None)
        table.add_row(str(layers), f"{100 * best['test_accuracy']:.1f}%", str(best["epoch"]),
                      "—" if first is None else str(first), f"{100 * mine[-1]['test_accuracy']:.1f}%")  # fmt: skip
    console.print(table)
    fewest = minimum_layers(rows)
    answer = "none of these depths" if fewest is None else f"{fewest} layer(s)"
    console.print(f"Fewest layers reaching {100 * TARGET_ACCURACY:.0f}% test accuracy: {answer}. [bold]wrote[/] {plot}")


def cmd_ar_handcrafted(args) -> None:
    from fastlm.tasks.associative_recall import accuracy, handcrafted_model, make_splits

    task = _recall_config(args)
    train, test = make_splits(task)
    model = handcrafted_model(task)
    test_accuracy, train_accuracy = accuracy(model, test), accuracy(model, train)
    console.print(f"Hand-built two-layer attention model (no training): test accuracy {100 * test_accuracy:.1f}% "
                  f"on {len(test)} sequences, train {100 * train_accuracy:.1f}%")  # fmt: skip


DTYPE_BYTES = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}


def cmd_analyze_layer(args) -> None:
    """`analyze attention|mha|mlp`: the per-stage cost table of one piece of a Transformer layer."""
    from fastlm.analysis import transformer as cost

    spec, n_bytes = device_spec(args.gpu), DTYPE_BYTES[args.dtype]
    b, n, d, h = args.batch, args.seq, args.d_model, args.heads
    try:
        if args.command == "attention":
            stages = [*cost.attention_stages(b, n, d, h, n_bytes), cost.sdpa_total(b, n, d, h, n_bytes)]
        elif args.command == "mha":
            stages = [*cost.mha_stages(b, n, d, h, n_bytes), cost.mha_total(b, n, d, h, n_bytes)]
        else:
            stages = [*cost.mlp_stages(b, n, d, n_bytes), cost.mlp_total(b, n, d, n_bytes)]
    except ValueError as error:
        raise UserError(str(error)) from None
    heads = f", H={h} (head dim {d // h})" if args.command != "mlp" else ""
    table = Table(title=f"{args.command} · B={b}, N={n}, D={d}{heads}, {args.dtype} · {spec.name} "
                        f"(ridge {spec.ridge_flops_per_byte:.0f} FLOP/B tensor cores, "
                        f"{spec.vector_ridge_flops_per_byte:.1f} CUDA cores)")  # fmt: skip
    for _, header in cost.STAGE_COLUMNS:
        table.add_column(header, justify="left" if header in ("stage", "bound", "scales as") else "right")
    for row in cost.render_stages(stages, spec):
        table.add_row(row["stage"], f"{row['flops']:.4g}", f"{row['bytes']:.4g}", f"{row['intensity']:.3g}",
                      row["verdict"], f"{row['min_time_us']:,.1f}", row["scaling"])  # fmt: skip
    console.print(table)
    console.print(
        "Every stage unfused: each reads its inputs from memory and writes its output once (module "
        "fastlm.analysis.transformer has the formulas). 'scales as' is how FLOPs and bytes grow with N."
    )


# ---------------------------------------------------------------------------------------------
# inspect, report
# ---------------------------------------------------------------------------------------------


def cmd_inspect_compiled_xent(args) -> None:
    from fastlm.profile.compiled_code import write_compiled_cross_entropy

    device = _device()
    with console.status("compiling F.cross_entropy with torch.compile"):
        path = write_compiled_cross_entropy(args.output, device)
    kind = "Triton" if device.type == "cuda" else "C++ (CPU; run on a GPU machine for the Triton kernels)"
    console.print(f"[bold]wrote[/] {kind} code generated for cross-entropy to {path}")


def cmd_inspect_autocast(args) -> None:
    from fastlm.profile.autocast import autocast_report

    console.print(autocast_report(_device(), args.terms), markup=False, highlight=False, soft_wrap=True)
    console.print("Why these dtypes, and why the sums drift: docs/mixed_precision.md")


def cmd_report(args) -> None:
    device = _device()
    xent_report = run_xent_benchmark(args.out, None, None)
    attention_report = run_attention_benchmark(args.out, ("model",))
    from fastlm.bench.model import rows

    preset = "small" if device.type == "cuda" else "tiny"
    model_report = run_model_benchmark(
        args.out,
        [(preset, ModelConfig.preset(preset))],
        rows(("fwd", "fwd+bwd", "train"), ("bf16",), ("eager", "compile") if device.type == "cuda" else ("eager",)),
        batch=4,
        warmup=5,
        steps=10,
        hf=False,
    )
    lines = [
        "# fastlm report",
        "",
        f"Device: {'GPU' if device.type == 'cuda' else 'CPU only'}.",
    ]
    if device.type != "cuda":
        lines += [
            "",
            "This machine has no GPU, so this is the reduced run: small batch, the tiny model preset, the "
            "plain-PyTorch reference "
            "paths instead of the Triton kernels, no torch.compile or Liger baselines. The Triton kernels, the "
            "compile and Liger baselines and the full-size shapes need a CUDA GPU; the numbers below say "
            "nothing about GPU performance.",
        ]
    lines += ["", xent_report.read_text().replace("# Cross-entropy benchmark", "## Cross-entropy")]
    lines += [
        "",
        attention_report.read_text().replace("# Attention benchmark", "## Attention").replace("\n## ", "\n### "),
    ]
    lines += ["", model_report.read_text().replace("# Model benchmark", f"## Language model ({preset} preset)")]
    from fastlm.bench import conv1d, linear_xent, norms, softmax

    for module, name, title in ((norms, "norms", "LayerNorm / RMSNorm"), (softmax, "softmax", "Masked softmax"),
                                (conv1d, "conv1d", "Causal conv1d"),
                                (linear_xent, "linear_xent", "Fused linear + cross-entropy")):  # fmt: skip
        section = run_bandwidth_benchmark(args.out, module, name, title).read_text()
        lines += ["", section.replace(f"# {title}", f"## {title}", 1)]
    host_modes = ("eager", "compile") if device.type == "cuda" else ("eager",)
    host_section = run_host_benchmark(args.out, None, host_modes, None, None).read_text().replace("\n## ", "\n### ")
    lines += ["", host_section.replace("# Host cost per call", "## Host cost per call", 1)]
    lines += ["", run_roofline(args.out).read_text().replace("# Roofline", "## Roofline", 1)]
    report = args.out / "reports" / "report.md"
    report.write_text("\n".join(lines))
    console.print(f"[bold]wrote[/] {report} (tables and plots under {report.parent})")


def add_model_arguments(p: argparse.ArgumentParser, gpu_preset: str = "small") -> None:
    """Which model: presets (or explicit dims), vocabulary, context, batch and kernel switches;
    ``gpu_preset`` is the default preset on a GPU machine (tiny without one)."""
    p.set_defaults(gpu_preset=gpu_preset)
    p.add_argument("--preset", type=_choice_list(PRESETS), default=None,
                   help=f"comma list of {', '.join(PRESETS)} (default on a GPU: {gpu_preset}; "
                   "without one: tiny)")  # fmt: skip
    p.add_argument("--d-model", type=_positive_int, default=None, help="custom model instead of a preset")
    p.add_argument("--d-ff", type=_positive_int, default=None)
    p.add_argument("--layers", type=_positive_int, default=None)
    p.add_argument("--heads", type=_positive_int, default=None)
    p.add_argument("--vocab", type=_positive_int, default=10000, help="vocabulary size (default 10000)")
    p.add_argument("--context", type=_positive_int, default=512, help="sequence length (default 512)")
    p.add_argument("--batch", type=_positive_int, default=4, help="sequences per step (default 4)")
    p.add_argument("--kernels", type=_choice_list(("torch", "fastlm")), default=("torch",),
                   help="comma list: torch (SDPA, PyTorch norm and loss) and/or fastlm (fused kernels)")  # fmt: skip
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default=None, help="override the attention kernel")
    p.add_argument("--norm", choices=NORM_KERNELS, default=None, help="override the norm kernel")
    p.add_argument("--softmax", choices=SOFTMAX_KERNELS, default=None,
                   help="override the softmax kernel of --attention naive")  # fmt: skip
    p.add_argument("--loss", choices=LOSS_KERNELS, default=None, help="override the loss kernel")


def build_parser() -> argparse.ArgumentParser:
    from fastlm.bench.model import COMPILE_MODES  # eager, compile, cudagraphs: bench model and train lm

    parser = argparse.ArgumentParser(prog="fastlm", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True)

    def add_out(p, default="fastlm-report"):
        p.add_argument("--out", type=Path, default=Path(default), help="folder for results/ and reports/")

    bench = groups.add_parser("bench", help="measure ops against their baselines").add_subparsers(
        dest="command", required=True
    )
    p = bench.add_parser("ceilings", help="measured copy GB/s and bf16 matmul TFLOP/s of this device")
    add_out(p)
    p.set_defaults(func=cmd_bench_ceilings)
    p = bench.add_parser("xent", help="cross-entropy fwd/bwd vs eager, compile, Liger")
    p.add_argument("--batch", type=_positive_int, default=None, help="rows (default 4096 on GPU, 128 on CPU)")
    p.add_argument(
        "--vocab", type=_int_list, default=None, help="comma-separated vocab sizes (default 32000,50264,128256)"
    )
    add_out(p)
    p.set_defaults(func=cmd_bench_xent)
    p = bench.add_parser("attention", help="attention: naive vs torch.compile vs fastlm vs SDPA flash/cuDNN")
    p.add_argument(
        "--sweep",
        type=_sweep_list,
        default=("model",),
        help="comma-separated sweeps among naive, compile, flash, model (default model)",
    )
    add_out(p)
    p.set_defaults(func=cmd_bench_attention)

    for name, help_text, func in (
        ("norms", "LayerNorm / RMSNorm fwd, bwd, fwd+bwd vs eager, compile, Liger", cmd_bench_norms),
        ("softmax", "masked softmax fwd, bwd, fwd+bwd vs eager, compile", cmd_bench_softmax),
        ("conv1d", "causal conv1d fwd, bwd, fwd+bwd vs eager, compile, CUDA C++ forward", cmd_bench_conv1d),
        ("linear-xent", "fused linear + cross-entropy fwd+bwd: ms, TFLOP/s, peak memory vs eager, compile, "
         "matmul + fastlm CE, Liger, CCE", cmd_bench_linear_xent),
        ("roofline", "this GPU's measured roofline with every benchmarked fastlm kernel on it", cmd_bench_roofline),
    ):  # benchmarks whose only option is --out
        p = bench.add_parser(name, help=help_text)
        add_out(p)
        p.set_defaults(func=func)
    from fastlm.bench import host

    p = bench.add_parser("host", help="host (CPU) time per call of each op vs the PyTorch op it replaces, "
                         "at small shapes where the host dominates")  # fmt: skip
    p.add_argument("--ops", type=_host_ops, default=None, help=f"comma list among {','.join(host.OPS)} (default all)")
    p.add_argument("--compile", type=_choice_list(host.COMPILE_MODES, "compile mode"), default=("eager",),
                   help="comma list of eager, compile (torch.compile(fullgraph=True) of each implementation, "
                   "fwd and bwd) (default eager)")  # fmt: skip
    p.add_argument("--rounds", type=_rounds, default=None,
                   help=f"rounds, each timing every implementation and direction (default {host.GPU_ROUNDS} on a "
                   f"GPU, {host.CPU_ROUNDS} without one; at least {host.MIN_ROUNDS})")  # fmt: skip
    p.add_argument("--calls", type=_positive_int, default=None,
                   help=f"calls per round and timing (default {host.GPU_CALLS} on a GPU, {host.CPU_CALLS} without "
                   "one)")  # fmt: skip
    add_out(p)
    p.set_defaults(func=cmd_bench_host)
    p = bench.add_parser("model", help="LM step time, tokens/s, MFU, peak memory (fwd, fwd+bwd, train)")
    add_model_arguments(p)
    p.add_argument("--mode", type=_choice_list(("fwd", "fwd+bwd", "train")), default=None,
                   help="comma list of fwd, fwd+bwd, train (default train)")  # fmt: skip
    p.add_argument("--precision", type=_choice_list(("fp32", "bf16")), default=None,
                   help="comma list of fp32, bf16 (autocast) (default bf16)")  # fmt: skip
    p.add_argument("--compile", type=_choice_list(COMPILE_MODES), default=None,
                   help="comma list of eager, compile (torch.compile), cudagraphs (torch.compile with "
                   "mode='reduce-overhead') (default eager; the sweep: eager, compile)")  # fmt: skip
    p.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed steps first, every round (default 5)")
    p.add_argument("--steps", type=_positive_int, default=10, help="timed steps per round (default 10)")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="rounds of warm-up + timed steps per row; the median over rounds is reported, with "
                   "the lowest and highest round's (default 3)")  # fmt: skip
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="round 1 of every row, then round 2, ..., every model kept (default: when the "
                   "models fit in memory together; else each row's rounds back to back)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="every preset but tiny x fwd, fwd+bwd, train x fp32, bf16 x eager, compile")  # fmt: skip
    p.add_argument("--hf", action="store_true", help="also measure transformers' LlamaForCausalLM of the same dims")
    add_out(p)
    p.set_defaults(func=cmd_bench_model)

    p = bench.add_parser("allreduce", help="all-reduce time, algbw and busbw vs size and number of processes")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with one GPU per process when there are GPUs, else gloo on CPU")  # fmt: skip
    p.add_argument("--procs", type=_int_list, default=(2, 4, 6), help="comma list of process counts (default 2,4,6)")
    p.add_argument("--sizes-mb", type=_float_list, default=(1, 10, 100, 1000),
                   help="comma list of float32 tensor sizes in MB (default 1,10,100,1000)")  # fmt: skip
    p.add_argument("--warmup", type=_non_negative_int, default=5)
    p.add_argument("--iters", type=_positive_int, default=10)
    add_out(p)
    p.set_defaults(func=cmd_bench_allreduce)

    from fastlm.distributed import ddp_bench

    p = bench.add_parser("ddp", help="data-parallel step time, communication overlap, optimizer-state sharding")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with a GPU per process when there are 2+ GPUs, else gloo on CPU")  # fmt: skip
    p.add_argument("--procs", type=_int_list, default=(2, 4), help="comma list of process counts (default 2,4)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="default xl with NCCL, tiny with gloo")
    p.add_argument("--vocab", type=_positive_int, default=10000)
    p.add_argument("--context", type=_positive_int, default=512)
    p.add_argument("--batch", type=_positive_int, default=4, help="sequences per rank (default 4)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="default bf16 (autocast)")
    p.add_argument("--variants", type=_variant_list, default=ddp_bench.VARIANTS,
                   help=f"comma list (default {','.join(ddp_bench.VARIANTS)}; bucketed-X for any X MB)")  # fmt: skip
    p.add_argument("--optimizers", type=_optimizer_list, default=ddp_bench.OPTIMIZERS,
                   help="memory rows: comma list of adamw, sharded (ShardedOptimizer), zero "
                   "(ZeroRedundancyOptimizer), or none")  # fmt: skip
    p.add_argument("--bucket-mb", type=_positive_float, default=25.0, help="BucketedDDP bucket size of the memory rows")
    p.add_argument("--warmup", type=_non_negative_int, default=3)
    p.add_argument("--steps", type=_positive_int, default=10)
    p.add_argument("--rounds", type=_positive_int, default=2,
                   help="passes over the variants, fresh models each (default 2); timings are pooled")  # fmt: skip
    p.add_argument("--profile-steps", type=_positive_int, default=2, help="profiled steps per variant (default 2)")
    add_out(p)
    p.set_defaults(func=cmd_bench_ddp)

    profile = groups.add_parser("profile", help="where time and memory go").add_subparsers(
        dest="command", required=True
    )
    p = profile.add_parser("model", help="kernel summary per range (forward, backward, optimizer, attention stages)")
    add_model_arguments(p)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="default bf16 (autocast)")
    p.add_argument("--warmup", type=_non_negative_int, default=3, help="untraced steps first (default 3)")
    p.add_argument("--steps", type=_positive_int, default=3, help="profiled steps per phase (default 3)")
    p.add_argument("--timing-steps", type=_positive_int, default=10,
                   help="steps per round (3 rounds) when timing the tool's own cost (default 10)")  # fmt: skip
    add_out(p)
    p.set_defaults(func=cmd_profile_model, attention=None)

    p = profile.add_parser("memory", help="allocator history, timelines and peak memory per context length")
    add_model_arguments(p, gpu_preset="2.7b")
    p.add_argument("--contexts", type=_int_list, default=(128, 256, 512), help="default 128,256,512")
    p.add_argument("--mode", type=_choice_list(("fwd", "train")), default=("fwd", "train"),
                   help="comma list of fwd (forward pass), train (full step with AdamW)")  # fmt: skip
    p.add_argument("--precision", type=_choice_list(("fp32", "bf16")), default=("fp32", "bf16"))
    add_out(p)
    p.set_defaults(func=cmd_profile_memory)

    analyze = groups.add_parser("analyze", help="napkin math: bytes, FLOPs, bound").add_subparsers(
        dest="command", required=True
    )
    p = analyze.add_parser("conv1d", help="cost model of the depthwise causal conv1d (bytes, FLOPs, bound)")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--length", type=_positive_int, default=8192)
    p.add_argument("--channels", type=_positive_int, default=8192)
    p.add_argument("--kernel-size", type=_positive_int, default=3)
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp16")
    p.add_argument("--activation", choices=("none", "silu"), default="none")
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help="datasheet to compare against")
    p.set_defaults(func=cmd_analyze_conv1d)
    p = analyze.add_parser("xent", help="cost model of fused cross-entropy")
    p.add_argument("--batch", type=_positive_int, default=4096)
    p.add_argument("--vocab", type=_positive_int, default=128256)
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help="datasheet to compare against")
    p.set_defaults(func=cmd_analyze_xent)

    p = analyze.add_parser("memory", help="parameters, gradients, AdamW state and activation sizes of a model")
    add_model_arguments(p)
    p.add_argument("--contexts", type=_int_list, default=(128, 256, 512), help="default 128,256,512")
    p.set_defaults(func=cmd_analyze_memory, preset=("2.7b",))

    p = analyze.add_parser("parallel", help="memory, GPUs, FSDP degree and compute-bound batch of a large MLP stack")
    p.add_argument("--d-model", type=_positive_int, default=16384, help="D (default 16384)")
    p.add_argument("--d-ff", type=_positive_int, default=53248, help="F (default 53248)")
    p.add_argument("--blocks", type=_positive_int, default=126, help="blocks of two linear layers (default 126)")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences whose activations are saved (default 1)")
    p.add_argument("--context", type=_positive_int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--gpu-memory-gb", type=_positive_float, default=80.0, help="GPU size for the count (default 80)")
    p.add_argument("--device-memory-gb", type=_positive_float, default=95.0,
                   help="per-device limit for the FSDP degree (default 95, TPU v5p)")  # fmt: skip
    p.add_argument("--w-ici", type=_positive_float, default=2 * 9e10,
                   help="W_ici, bidirectional ICI bytes/s per axis (default 1.8e11, TPU v5p)")  # fmt: skip
    p.add_argument("--flops", type=_positive_float, default=4.6e14, help="C, FLOP/s per chip (default 4.6e14)")
    p.add_argument("--mx", type=_positive_int, default=2, help="M_X, mesh axes of the FSDP dimension (default 2)")
    p.add_argument("--my", type=_positive_int, default=1, help="M_Y, mesh axes of the TP dimension (default 1)")
    p.add_argument("--x", type=_positive_int, default=16, help="X, FSDP degree (default 16)")
    p.add_argument("--y", type=_positive_int, default=4, help="Y, TP degree (default 4)")
    p.set_defaults(func=cmd_analyze_parallel)

    def add_recall_arguments(p):
        p.add_argument("--keys", type=_positive_int, default=16, help="key vocabulary (default 16)")
        p.add_argument("--values", type=_positive_int, default=16, help="value vocabulary (default 16)")
        p.add_argument("--pairs", type=_positive_int, default=8, help="key-value pairs per sequence (default 8)")
        p.add_argument("--train", type=_positive_int, default=8000, help="training sequences (default 8000)")
        p.add_argument("--test", type=_positive_int, default=1000, help="test sequences (default 1000)")
        p.add_argument("--seed", type=int, default=0)

    train = groups.add_parser("train", help="train the model on a task").add_subparsers(dest="command", required=True)
    p = train.add_parser("lm", help="the LM on a byte-level text corpus, torch vs fastlm kernels: time, loss")
    p.add_argument("--data", type=Path, required=True, help="any UTF-8 text file")
    p.add_argument("--preset", choices=PRESETS, default=None, help="default small on a GPU, tiny without one")
    p.add_argument("--kernels", type=_choice_list(("torch", "fastlm")), default=("torch", "fastlm"),
                   help="comma list of kernel sets, each from the same start (default torch,fastlm)")  # fmt: skip
    p.add_argument("--context", type=_positive_int, default=256)
    p.add_argument("--batch", type=_positive_int, default=16)
    p.add_argument("--epochs", type=_positive_int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default bf16 on a GPU, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", choices=COMPILE_MODES, default="eager",
                   help="eager (default), torch.compile, or cudagraphs (torch.compile with "
                   "mode='reduce-overhead')")  # fmt: skip
    add_out(p)
    p.set_defaults(func=cmd_train_lm)
    p = train.add_parser("ar", help="associative recall: test accuracy per epoch, sweep over depth")
    add_recall_arguments(p)
    p.add_argument("--layers", type=_int_list, default=(2,), help="comma list of depths, e.g. 1,2,3,4 (default 2)")
    p.add_argument("--epochs", type=_positive_int, default=50)
    p.add_argument("--d-model", type=_positive_int, default=64)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--batch", type=_positive_int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    add_out(p)
    p.set_defaults(func=cmd_train_ar)

    ar = groups.add_parser("ar", help="associative recall without training").add_subparsers(
        dest="command", required=True
    )
    p = ar.add_parser("handcrafted", help="score the hand-built two-layer attention model")
    add_recall_arguments(p)
    p.set_defaults(func=cmd_ar_handcrafted)

    for name, description in (("attention", "scaled-dot-product attention, stage by stage"),
                              ("mha", "multi-head attention: projections, attention, output"),
                              ("mlp", "two-layer MLP D -> 4D -> D")):  # fmt: skip
        p = analyze.add_parser(name, help=f"cost model of {description}")
        p.add_argument("--batch", type=_positive_int, default=16)
        p.add_argument("--seq", type=_positive_int, default=16384, help="sequence length N")
        p.add_argument("--d-model", type=_positive_int, default=4096, help="model width D")
        p.add_argument("--heads", type=_positive_int, default=32)
        p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp16", help="element type (bytes per element)")
        p.add_argument("--gpu", default="a100", choices=sorted(DEVICES), help="datasheet to compare against")
        p.set_defaults(func=cmd_analyze_layer)

    inspect = groups.add_parser("inspect", help="look at generated code").add_subparsers(dest="command", required=True)
    p = inspect.add_parser("compiled-xent", help="write the code torch.compile generates for cross-entropy")
    p.add_argument("--output", type=Path, default=Path("compiled_cross_entropy.py"))
    p.set_defaults(func=cmd_inspect_compiled_xent)

    p = inspect.add_parser("autocast", help="dtypes of a small model under fp16/bf16 autocast; fp16 vs fp32 sums")
    p.add_argument("--terms", type=_positive_int, default=1000, help="terms of 0.01 in the accumulation demo")
    p.set_defaults(func=cmd_inspect_autocast)

    p = groups.add_parser("report", help="the main job: ceilings + every benchmark, written as a markdown report")
    add_out(p)
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as error:
        console.print(f"[red]error:[/] {error}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
