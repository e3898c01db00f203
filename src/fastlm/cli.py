"""`fastlm <group> <command>`: benchmarks, cost models, inspection and the main report.

User mistakes (bad flag values, unknown GPU, a GPU-only command without a GPU) end with one
clear sentence and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fastlm.analysis.transformer import DTYPE_BYTES
from fastlm.bench.options import (
    ATTENTION_SWEEPS,
    DDP_OPTIMIZERS,
    DDP_VARIANTS,
    HOST_COMPILE_MODES,
    HOST_CPU_CALLS,
    HOST_CPU_ROUNDS,
    HOST_CPU_WARMUP,
    HOST_GPU_CALLS,
    HOST_GPU_ROUNDS,
    HOST_GPU_WARMUP,
    HOST_MIN_ROUNDS,
    HOST_OPS,
    check_ddp_variant,
)
from fastlm.devices import DEVICES, device_spec
from fastlm.model.config import (
    ATTENTION_KERNELS,
    COMPILE_MODES,
    LOSS_KERNELS,
    NORM_KERNELS,
    PRESETS,
    SOFTMAX_KERNELS,
    ModelConfig,
)

console = Console()
error_console = Console(stderr=True)


class UserError(Exception):
    """A mistake in how fastlm was called; printed as one sentence."""


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _print_line(text: str) -> None:
    """One line, flushed, so it shows at once also when the output is piped: a note, or progress.
    Module-level, so the distributed benchmarks' worker processes can unpickle it and report from
    rank 0 (a bar redrawn by this process would garble their lines, so those print lines only)."""
    print(text, flush=True)


@contextlib.contextmanager
def _steps(name: str, total: int):
    """Yields ``step(done="")`` for a long run: a progress bar on a terminal; one plain line per step,
    flushed, when the output is piped or logged (where a bar would show only once, at the end)."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(name, total=total)
            yield lambda done="": progress.update(task, description=f"{name} ({done})" if done else name, advance=1)
        return
    count = 0

    def step(done: str = "") -> None:
        nonlocal count
        count += 1
        _print_line(f"{name} {count}/{total}" + (f": {done}" if done else ""))

    yield step


def _note_without_gpu(device, note: str) -> None:
    """Say what a GPU benchmark run on the CPU does not measure, before it starts."""
    if device.type != "cuda":
        _print_line(note)


def _write_report(path: Path, title: str, body: str) -> Path:
    """A markdown report: ``# title``, then ``body``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{body}\n")
    return path


def _show_report(report: Path) -> None:
    """Print a written report and where it is."""
    console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote[/] {report}")


# ---------------------------------------------------------------------------------------------
# Argument types: each rejects a bad value with one sentence, which argparse prefixes with the
# option's name ("argument --lr: expected a positive finite number, got 'nan'") and exits with 2
# ---------------------------------------------------------------------------------------------


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
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None


def _seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63), the range torch's generators take."""
    value = _non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**63, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _comma_list(parse_one, what: str):
    """argparse type: a non-empty comma list, each part parsed by ``parse_one``."""

    def parse(text: str) -> tuple:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {text!r}")
        try:
            return tuple(parse_one(part) for part in parts)
        except argparse.ArgumentTypeError as error:
            if len(parts) == 1:
                raise
            raise argparse.ArgumentTypeError(f"{error} in the comma list {text!r}") from None

    return parse


_int_list = _comma_list(_positive_int, "positive integers")
_float_list = _comma_list(_positive_float, "positive numbers")


def _choice_list(choices: Sequence[str], what: str = "value"):
    """argparse type: a non-empty comma-separated subset of ``choices``."""

    def parse_one(part: str) -> str:
        if part not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {part!r}; choose from {', '.join(choices)}")
        return part

    return _comma_list(parse_one, f"{what}s among {', '.join(choices)}")


def _text_file(text: str) -> Path:
    """An existing, readable, non-empty file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}" if not path.exists() else f"{text!r} is not a file")
    try:
        size = path.stat().st_size
        with path.open("rb"):
            pass
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {error.strerror}") from None
    if size == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is empty")
    return path


def _folder(text: str) -> Path:
    """A folder to write into: missing (it is created) or an existing folder, not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return path


def _output_file(text: str) -> Path:
    """A file to write: not an existing folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    return path


_host_ops = _choice_list(HOST_OPS, "op")
_sweep_list = _choice_list(ATTENTION_SWEEPS, "sweep")


def _rounds(text: str) -> int:
    value = _positive_int(text)
    if value < HOST_MIN_ROUNDS:
        raise argparse.ArgumentTypeError(f"expected at least {HOST_MIN_ROUNDS} rounds (a median and a spread), "
                                         f"got {value}")  # fmt: skip
    return value


def _ddp_variant(part: str) -> str:
    try:
        return check_ddp_variant(part)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_variant_list = _comma_list(_ddp_variant, "variants")


def _optimizer_list(text: str) -> tuple[str, ...]:
    return () if text == "none" else _choice_list(DDP_OPTIMIZERS, "optimizer")(text)


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
    table.add_row(f"{record['copy_gbps']:.3g}", f"{record['matmul_tflops']:.3g}", f"{shape} {record['matmul_dtype']}",
                  datasheet)  # fmt: skip
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
    _note_without_gpu(device, xent.CPU_NOTE)
    ceilings = record_ceilings(results_dir, device)
    with _steps("cross-entropy", len(vocabs) * len(xent.IMPLEMENTATIONS)) as step:
        xent.run(batch=batch, vocabs=vocabs, device=device, ceilings=ceilings, results_dir=results_dir, progress=step)
    report = _write_report(reports_dir / "xent.md", "Cross-entropy benchmark", xent.render(results_dir, reports_dir))
    return report


def cmd_bench_xent(args) -> None:
    report = run_xent_benchmark(args.out, args.batch, args.vocab)
    _show_report(report)


def run_bandwidth_benchmark(out: Path, module, name: str, title: str) -> Path:
    """`bench norms | softmax | conv1d`: copy ceiling, every case x implementation; the report's path."""
    from fastlm.bench.bandwidth import CPU_NOTE
    from fastlm.bench.ceilings import record_ceilings

    device = _device()
    _note_without_gpu(device, CPU_NOTE)
    results_dir, reports_dir = out / "results", out / "reports"
    ceilings = record_ceilings(results_dir, device)
    with _steps(name, len(module.cases(device)) * len(module.IMPLEMENTATIONS)) as step:
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
    _note_without_gpu(_device(), roofline.CPU_NOTE)
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


def run_host_benchmark(
    out: Path, ops: Sequence[str] | None, modes: Sequence[str], rounds: int | None, calls: int | None
) -> Path:
    """Host cost per call of each op vs its PyTorch op (`fastlm.bench.host`); returns the report path.
    ``None`` picks all ops, and the rounds and calls of this device (fewer on CPU)."""
    from fastlm.bench import host

    device = _device()
    on_gpu = device.type == "cuda"
    cases = [host.CASES[name] for name in (ops or HOST_OPS)]
    _note_without_gpu(device, host.CPU_NOTE)
    with _steps("host cost", len(cases) * len(modes)) as step:
        host.run(cases, modes, device, out / "results", progress=step,
                 rounds=rounds or (HOST_GPU_ROUNDS if on_gpu else HOST_CPU_ROUNDS),
                 calls=calls or (HOST_GPU_CALLS if on_gpu else HOST_CPU_CALLS),
                 warmup=HOST_GPU_WARMUP if on_gpu else HOST_CPU_WARMUP)  # fmt: skip
    body = host.render(out / "results", out / "reports")
    return _write_report(out / "reports" / "host.md", "Host cost per call: fastlm vs PyTorch", body)


def cmd_bench_host(args) -> None:
    _show_report(run_host_benchmark(args.out, args.ops, args.compile, args.rounds, args.calls))


def run_attention_benchmark(out: Path, sweeps: tuple[str, ...]) -> Path:
    """The attention sweeps, then their markdown report; returns the report path."""
    from fastlm.bench import attention

    device = _device()
    _note_without_gpu(device, attention.CPU_NOTE)
    results_dir, reports_dir = out / "results", out / "reports"
    with _steps("attention", attention.total_measurements(sweeps, device)) as step:
        attention.run(sweeps, device, results_dir, progress=step)
    return _write_report(
        reports_dir / "attention.md", "Attention benchmark", attention.render(results_dir, reports_dir)
    )


def cmd_bench_attention(args) -> None:
    report = run_attention_benchmark(args.out, args.sweep)
    _show_report(report)


def _check_heads(d_model: int, heads: int, rope: bool = False) -> None:
    """--d-model splits into --heads heads; with ``rope`` (the model, not a cost model) each head's
    width must be even too, since RoPE rotates pairs of dimensions."""
    if d_model % heads:
        raise UserError(f"--d-model ({d_model}) must be divisible by --heads ({heads})")
    if rope and (d_model // heads) % 2:
        raise UserError(f"--d-model / --heads ({d_model} / {heads} = {d_model // heads}) must be even: RoPE rotates "
                        "pairs of dimensions")  # fmt: skip


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
        _check_heads(args.d_model, args.heads, rope=True)
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
    _note_without_gpu(device, model_bench.CPU_NOTE)
    with _steps("model", len(model_bench.subjects(configs, implementations)) * len(rows) * rounds) as step:
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
        raise UserError(f"--backend nccl needs one GPU per process; this machine has {torch.cuda.device_count()}")
    worlds = [n for n in args.procs if backend == "gloo" or n <= torch.cuda.device_count()]
    skipped = sorted(set(args.procs) - set(worlds))
    if skipped:
        console.print(f"skipping {', '.join(map(str, skipped))} processes: only {torch.cuda.device_count()} GPUs")
    results_dir, reports_dir = args.out / "results", args.out / "reports"
    if backend == "gloo":
        _print_line(allreduce_bench.GLOO_NOTE)
    allreduce_bench.run(backend, worlds, args.sizes_mb, results_dir, warmup=args.warmup, iters=args.iters,
                        progress=_print_line)  # fmt: skip
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
        raise UserError(f"--backend nccl needs one GPU per process; this machine has {torch.cuda.device_count()}")
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
    if backend == "gloo":
        _print_line(ddp_bench.GLOO_NOTE)
    ddp_bench.run(backend, worlds, settings, args.variants, args.optimizers, results_dir, progress=_print_line)
    report = _write_report(
        reports_dir / "ddp.md", "Data-parallel training benchmark", ddp_bench.render(results_dir, reports_dir)
    )
    _show_report(report)


# ---------------------------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------------------------


def _single_model_config(args) -> tuple[str, ModelConfig]:
    configs = model_configs(args)
    if len(configs) != 1:
        raise UserError(f"--preset and --kernels name {len(configs)} models (presets x kernel sets); "
                        f"{args.group} {args.command} takes one")  # fmt: skip
    return configs[0]


def run_model_profile(
    out: Path, preset: str, config: ModelConfig, *, batch, precision, warmup, steps, timing_steps
) -> Path:
    """Profile inference and a training step; write the markdown summary; returns its path."""
    from fastlm.profile import model as model_profile

    with _steps(f"profiling {preset}", model_profile.PROGRESS_STEPS) as step:
        profiles, records = model_profile.run(config, preset, batch=batch, precision=precision, warmup=warmup,
                                              steps=steps, device=_device(), out=out, timing_steps=timing_steps,
                                              progress=step)  # fmt: skip
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
    with _steps("memory", len(args.mode) * len(args.precision) * len(args.contexts)) as step:
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


def _print_all(parts) -> None:
    for part in parts:
        console.print(part)


def cmd_analyze_xent(args) -> None:
    from fastlm.analysis.xent import CrossEntropyCost, cost_tables

    _print_all(cost_tables(CrossEntropyCost(args.batch, args.vocab), device_spec(args.gpu)))


def cmd_analyze_conv1d(args) -> None:
    from fastlm.analysis.conv1d import Conv1dCost, cost_tables

    sizes = {"fp32": 4, "fp16": 2, "bf16": 2}
    cost = Conv1dCost(args.batch, args.length, args.channels, args.kernel_size, sizes[args.dtype],
                      bias=not args.no_bias, silu=args.activation == "silu")  # fmt: skip
    _print_all(cost_tables(cost, args.dtype, device_spec(args.gpu)))


def cmd_analyze_memory(args) -> None:
    from fastlm.analysis.model import memory_table

    preset, config = _single_model_config(args)
    console.print(memory_table(config, preset, args.batch, args.contexts))


def cmd_analyze_parallel(args) -> None:
    """`analyze parallel`: memory, GPUs, FSDP degree and compute-bound batch of a stack of MLP blocks."""
    from fastlm.analysis import parallel

    try:
        config = parallel.ParallelConfig(d_model=args.d_model, d_ff=args.d_ff, blocks=args.blocks, batch=args.batch,
                                         context_length=args.context)  # fmt: skip
        mesh = parallel.MeshConfig(w_ici=args.w_ici, flops=args.flops, m_x=args.mx, m_y=args.my, x=args.x, y=args.y)
    except ValueError as error:
        raise UserError(str(error)) from None
    _print_all(parallel.cost_tables(config, mesh, args.gpu_memory_gb, args.device_memory_gb))


# ---------------------------------------------------------------------------------------------
# train, ar
# ---------------------------------------------------------------------------------------------


RECALL_OPTIONS = {"num_keys": "--keys", "num_values": "--values", "num_pairs": "--pairs", "num_train": "--train",
                  "num_test": "--test"}  # fmt: skip


def _recall_config(args):
    from fastlm.tasks.associative_recall import RecallConfig

    try:
        return RecallConfig(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                            num_train=args.train, num_test=args.test, seed=args.seed)  # fmt: skip
    except ValueError as error:  # the config names its fields; say which options they are
        message = str(error)
        for field, option in RECALL_OPTIONS.items():
            message = message.replace(field, option)
        raise UserError(message) from None


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
        raise UserError(f"--data: {error}") from None
    steps = settings.epochs * -(-windows[0].shape[0] // settings.batch)
    runs = []
    for kernels in args.kernels:
        with _steps(f"{kernels} kernels, step", steps) as step:
            # the loss is not read here: that would synchronize
            runs.append(train_kernels(windows, kernels, settings, device, on_step=lambda done, loss: step()))
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
    _check_heads(settings.d_model, settings.num_heads, rope=True)
    splits = make_splits(task)
    rows = []
    for layers in args.layers:
        with _steps(f"{layers} layer(s), epoch", settings.epochs) as step:
            rows += train_depth(task, splits, layers, settings, on_epoch=lambda row: step(
                f"test accuracy {100 * row['test_accuracy']:.1f}%, loss {row['train_loss']:.3f}"))  # fmt: skip
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


def cmd_analyze_layer(args) -> None:
    """`analyze attention|mha|mlp`: the per-stage cost table of one piece of a Transformer layer."""
    from fastlm.analysis.transformer import layer_tables

    if args.command != "mlp":
        _check_heads(args.d_model, args.heads)
    _print_all(layer_tables(args.command, args.batch, args.seq, args.d_model, args.heads, args.dtype,
                            device_spec(args.gpu)))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# inspect, report
# ---------------------------------------------------------------------------------------------


def cmd_inspect_compiled_xent(args) -> None:
    from fastlm.profile.compiled_code import write_compiled_cross_entropy

    device = _device()
    _print_line("compiling F.cross_entropy (forward and backward) with torch.compile")
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


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: "(default: X)" is added unless the help already
    says what the default is (defaults that depend on the device are spelled out there). On/off
    flags are off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or any(action.default is v for v in (None, argparse.SUPPRESS, False)):
            return text
        value = action.default
        if isinstance(value, (tuple, list)):
            value = ",".join(map(str, value))
        elif isinstance(value, float):
            value = f"{value:g}"
        return f"{text} (default: {str(value).replace('%', '%%')})"  # argparse %-formats help strings


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser with the formatter above; subcommands inherit it, since add_subparsers
    makes its parsers of the parent's class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


# Wall time of the commands that take more than a few seconds, with their defaults, for their
# --help: measured on an otherwise idle 2-core CPU (torch's CPU build; processes that share the
# cores take longer); on GPUs from the run books in benchmarks/, whose calls run 10 minutes at most.
DURATIONS = {
    "bench xent": ("about a minute", "under 10 minutes"),
    "bench attention": ("about 10 seconds", "under 10 minutes"),
    "bench norms": ("about 10 seconds", "under 10 minutes"),
    "bench softmax": ("about 10 seconds", "under 10 minutes"),
    "bench conv1d": ("about 10 seconds", "under 10 minutes"),
    "bench host": ("about 20 seconds", "under 10 minutes"),
    "bench model": (
        "about 15 seconds",
        "under 10 minutes, plus 2-4 minutes of compilation per large model and compile mode",
    ),
    "bench allreduce": ("about 2 minutes", "under 10 minutes"),
    "bench ddp": (
        "5 to 10 minutes for --procs 2, and longer for 4 processes than for 2 on 2 cores",
        "about 5 minutes for --procs 8 --rounds 2",
    ),
    "profile model": ("about 30 seconds", "under 10 minutes"),
    "profile memory": ("about 20 seconds", "under 10 minutes"),
    "train lm": (
        "about 4 seconds per kernel set for the 8 kB tests/data/corpus.txt, growing with the text",
        "a few seconds per epoch of 600 kB of text (small preset), plus compilation under --compile",
    ),
    "train ar": (
        "about 2 minutes for the default depth (2 layers), about 10 minutes for --layers 1,2,3,4",
        "the same: it trains on the CPU",
    ),
    "inspect compiled-xent": ("about 10 seconds", "under 10 minutes"),
    "report": ("about 3 minutes", "the sum of its benchmarks' times, each given in their --help"),
}


def add_model_arguments(p: argparse.ArgumentParser, gpu_preset: str = "small") -> None:
    """Which model: presets (or explicit dims), vocabulary, context, batch and kernel switches;
    ``gpu_preset`` is the default preset on a GPU machine (tiny without one)."""
    p.set_defaults(gpu_preset=gpu_preset)
    p.add_argument("--preset", type=_choice_list(PRESETS, "preset"), default=None,
                   help=f"comma list of {', '.join(PRESETS)} (default on a GPU: {gpu_preset}; "
                   "without one: tiny)")  # fmt: skip
    custom = "custom model instead of a preset, with --d-model, --d-ff, --layers and --heads (default: a preset)"
    p.add_argument("--d-model", type=_positive_int, default=None, help=f"model width; {custom}")
    p.add_argument("--d-ff", type=_positive_int, default=None, help=f"MLP hidden width; {custom}")
    p.add_argument("--layers", type=_positive_int, default=None, help=f"Transformer blocks; {custom}")
    p.add_argument("--heads", type=_positive_int, default=None, help=f"attention heads; {custom}")
    p.add_argument("--vocab", type=_positive_int, default=10000, help="vocabulary size")
    p.add_argument("--context", type=_positive_int, default=512, help="sequence length")
    p.add_argument("--batch", type=_positive_int, default=4, help="sequences per step")
    p.add_argument("--kernels", type=_choice_list(("torch", "fastlm"), "kernel set"), default=("torch",),
                   help="comma list: torch (SDPA, PyTorch norm and loss) and/or fastlm (fused kernels)")  # fmt: skip
    kernel_default = "(default: the kernel set's)"
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default=None,
                   help=f"override the attention kernel {kernel_default}")  # fmt: skip
    p.add_argument("--norm", choices=NORM_KERNELS, default=None, help=f"override the norm kernel {kernel_default}")
    p.add_argument("--softmax", choices=SOFTMAX_KERNELS, default=None,
                   help=f"override the softmax kernel of --attention naive {kernel_default}")  # fmt: skip
    p.add_argument("--loss", choices=LOSS_KERNELS, default=None, help=f"override the loss kernel {kernel_default}")


@functools.cache  # parsing leaves the parser unchanged: one per process (main runs in-process in tests)
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastlm", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True)
    subcommands = {}

    def sentence(summary: str) -> str:
        return f"{summary[0].upper()}{summary[1:]}."

    def add_group(name: str, summary: str) -> None:
        group = groups.add_parser(name, help=summary, description=sentence(summary))
        subcommands[name] = group.add_subparsers(dest="command", required=True)

    def add_command(group: str | None, name: str, summary: str, func) -> argparse.ArgumentParser:
        """A subcommand: ``summary`` in its group's list; its --help adds the expected duration."""
        description = sentence(summary)
        if (key := " ".join(filter(None, (group, name)))) in DURATIONS:
            cpu, gpu = DURATIONS[key]
            description += f" Expected duration with the defaults: on a 2-core CPU {cpu}; on a GPU {gpu}."
        p = (subcommands[group] if group else groups).add_parser(name, help=summary, description=description)
        p.set_defaults(func=func)
        return p

    def add_out(p):
        p.add_argument("--out", type=_folder, default=Path("fastlm-report"), help="folder for results/ and reports/")

    add_group("bench", "measure ops against their baselines")
    p = add_command("bench", "ceilings", "measured copy GB/s and matmul TFLOP/s (bf16 on a GPU, fp32 on a CPU) of "
                    "this device", cmd_bench_ceilings)  # fmt: skip
    add_out(p)
    p = add_command("bench", "xent", "cross-entropy fwd/bwd vs eager, compile, Liger", cmd_bench_xent)
    p.add_argument("--batch", type=_positive_int, default=None, help="rows (default 4096 on a GPU, 128 on a CPU)")
    p.add_argument("--vocab", type=_int_list, default=None,
                   help="comma list of vocabulary sizes (default 32000,50264,128256)")  # fmt: skip
    add_out(p)
    p = add_command("bench", "attention", "attention: naive vs torch.compile vs fastlm vs SDPA flash/cuDNN",
                    cmd_bench_attention)  # fmt: skip
    p.add_argument("--sweep", type=_sweep_list, default=("model",),
                   help="comma list of sweeps among naive, compile, flash, model")  # fmt: skip
    add_out(p)
    for name, summary, func in (
        ("norms", "LayerNorm / RMSNorm fwd, bwd, fwd+bwd vs eager, compile, Liger", cmd_bench_norms),
        ("softmax", "masked softmax fwd, bwd, fwd+bwd vs eager, compile", cmd_bench_softmax),
        ("conv1d", "causal conv1d fwd, bwd, fwd+bwd vs eager, compile, CUDA C++ forward", cmd_bench_conv1d),
        (
            "linear-xent",
            "fused linear + cross-entropy fwd+bwd: ms, TFLOP/s, peak memory vs eager, compile, "
            "matmul + fastlm CE, Liger, CCE",
            cmd_bench_linear_xent,
        ),
        ("roofline", "this device's measured roofline with every benchmarked fastlm kernel on it", cmd_bench_roofline),
    ):  # benchmarks whose only option is --out
        add_out(add_command("bench", name, summary, func))
    p = add_command("bench", "host", "host (CPU) time per call of each op vs the PyTorch op it replaces, at small "
                    "shapes where the host dominates", cmd_bench_host)  # fmt: skip
    p.add_argument("--ops", type=_host_ops, default=None, help=f"comma list among {','.join(HOST_OPS)} (default all)")
    p.add_argument("--compile", type=_choice_list(HOST_COMPILE_MODES, "compile mode"), default=("eager",),
                   help="comma list of eager, compile (torch.compile(fullgraph=True) of each implementation, "
                   "fwd and bwd)")  # fmt: skip
    p.add_argument("--rounds", type=_rounds, default=None,
                   help=f"rounds, each timing every implementation and direction (default {HOST_GPU_ROUNDS} on a "
                   f"GPU, {HOST_CPU_ROUNDS} without one; at least {HOST_MIN_ROUNDS})")  # fmt: skip
    p.add_argument("--calls", type=_positive_int, default=None,
                   help=f"calls per round and timing (default {HOST_GPU_CALLS} on a GPU, {HOST_CPU_CALLS} without "
                   "one)")  # fmt: skip
    add_out(p)
    p = add_command("bench", "model", "LM step time, tokens/s, MFU, peak memory (fwd, fwd+bwd, train)",
                    cmd_bench_model)  # fmt: skip
    add_model_arguments(p)
    p.add_argument("--mode", type=_choice_list(("fwd", "fwd+bwd", "train"), "mode"), default=None,
                   help="comma list of fwd, fwd+bwd, train (default train)")  # fmt: skip
    p.add_argument("--precision", type=_choice_list(("fp32", "bf16"), "precision"), default=None,
                   help="comma list of fp32, bf16 (autocast) (default bf16)")  # fmt: skip
    p.add_argument("--compile", type=_choice_list(COMPILE_MODES, "compile mode"), default=None,
                   help="comma list of eager, compile (torch.compile), cudagraphs (torch.compile with "
                   "mode='reduce-overhead') (default eager; the sweep: eager, compile)")  # fmt: skip
    p.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed steps first, every round")
    p.add_argument("--steps", type=_positive_int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="rounds of warm-up + timed steps per row; the median over rounds is reported, with "
                   "the lowest and highest round's")  # fmt: skip
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="round 1 of every row, then round 2, ..., every model kept (default: when the "
                   "models fit in memory together; else each row's rounds back to back)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="every preset but tiny x fwd, fwd+bwd, train x fp32, bf16 x eager, compile")  # fmt: skip
    p.add_argument("--hf", action="store_true", help="also measure transformers' LlamaForCausalLM of the same dims")
    add_out(p)

    p = add_command("bench", "allreduce", "all-reduce time, algbw and busbw vs size and number of processes",
                    cmd_bench_allreduce)  # fmt: skip
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with one GPU per process when there are GPUs, else gloo on CPU")  # fmt: skip
    p.add_argument("--procs", type=_int_list, default=(2, 4, 6), help="comma list of process counts")
    p.add_argument("--sizes-mb", type=_float_list, default=(1, 10, 100, 1000),
                   help="comma list of float32 tensor sizes in MB")  # fmt: skip
    p.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed all-reduces per size")
    p.add_argument("--iters", type=_positive_int, default=10, help="timed all-reduces per size")
    add_out(p)

    p = add_command("bench", "ddp", "data-parallel step time, communication overlap, optimizer-state sharding",
                    cmd_bench_ddp)  # fmt: skip
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL with a GPU per process when there are 2+ GPUs, else gloo on CPU")  # fmt: skip
    p.add_argument("--procs", type=_int_list, default=(2, 4), help="comma list of process counts")
    p.add_argument(
        "--preset", choices=PRESETS, default=None, help="model preset (default xl with NCCL, tiny with gloo)"
    )
    p.add_argument("--vocab", type=_positive_int, default=10000, help="vocabulary size")
    p.add_argument("--context", type=_positive_int, default=512, help="sequence length")
    p.add_argument("--batch", type=_positive_int, default=4, help="sequences per rank")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="fp32, or bf16 (autocast)")
    p.add_argument("--variants", type=_variant_list, default=DDP_VARIANTS,
                   help="comma list of gradient synchronizations; bucketed-X for any X MB")  # fmt: skip
    p.add_argument("--optimizers", type=_optimizer_list, default=DDP_OPTIMIZERS,
                   help="memory rows: comma list of adamw, sharded (ShardedOptimizer), zero "
                   "(ZeroRedundancyOptimizer), or none")  # fmt: skip
    p.add_argument("--bucket-mb", type=_positive_float, default=25.0, help="BucketedDDP bucket size of the memory rows")
    p.add_argument("--warmup", type=_non_negative_int, default=3, help="untimed steps per variant and round")
    p.add_argument("--steps", type=_positive_int, default=10, help="timed steps per variant and round")
    p.add_argument("--rounds", type=_positive_int, default=2,
                   help="passes over the variants, fresh models each; timings are pooled")  # fmt: skip
    p.add_argument("--profile-steps", type=_positive_int, default=2, help="profiled steps per variant")
    add_out(p)

    add_group("profile", "where time and memory go")
    p = add_command("profile", "model", "kernel summary per range (forward, backward, optimizer, attention stages)",
                    cmd_profile_model)  # fmt: skip
    add_model_arguments(p)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16", help="fp32, or bf16 (autocast)")
    p.add_argument("--warmup", type=_non_negative_int, default=3, help="untraced steps first")
    p.add_argument("--steps", type=_positive_int, default=3, help="profiled steps per phase")
    p.add_argument("--timing-steps", type=_positive_int, default=10,
                   help="steps per round (3 rounds) when timing the tool's own cost")  # fmt: skip
    add_out(p)
    p.set_defaults(attention=None)
    p = add_command("profile", "memory", "allocator history, timelines and peak memory per context length",
                    cmd_profile_memory)  # fmt: skip
    add_model_arguments(p, gpu_preset="2.7b")
    p.add_argument("--contexts", type=_int_list, default=(128, 256, 512), help="comma list of context lengths")
    p.add_argument("--mode", type=_choice_list(("fwd", "train"), "mode"), default=("fwd", "train"),
                   help="comma list of fwd (forward pass), train (full step with AdamW)")  # fmt: skip
    p.add_argument("--precision", type=_choice_list(("fp32", "bf16"), "precision"), default=("fp32", "bf16"),
                   help="comma list of fp32, bf16 (autocast)")  # fmt: skip
    add_out(p)

    add_group("analyze", "napkin math: bytes, FLOPs, bound")
    datasheet = "datasheet to compare against"
    p = add_command("analyze", "conv1d", "cost model of the depthwise causal conv1d (bytes, FLOPs, bound)",
                    cmd_analyze_conv1d)  # fmt: skip
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences B")
    p.add_argument("--length", type=_positive_int, default=8192, help="sequence length L")
    p.add_argument("--channels", type=_positive_int, default=8192, help="channels D")
    p.add_argument("--kernel-size", type=_positive_int, default=3, help="taps K")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp16", help="element type")
    p.add_argument("--activation", choices=("none", "silu"), default="none", help="fused activation")
    p.add_argument("--no-bias", action="store_true", help="no bias vector (default: with one)")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help=datasheet)
    p = add_command("analyze", "xent", "cost model of fused cross-entropy", cmd_analyze_xent)
    p.add_argument("--batch", type=_positive_int, default=4096, help="rows B (tokens)")
    p.add_argument("--vocab", type=_positive_int, default=128256, help="vocabulary size V")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help=datasheet)
    p = add_command("analyze", "memory", "parameters, gradients, AdamW state and activation sizes of a model",
                    cmd_analyze_memory)  # fmt: skip
    add_model_arguments(p)
    p.add_argument("--contexts", type=_int_list, default=(128, 256, 512), help="comma list of context lengths")
    p.set_defaults(preset=("2.7b",))
    p = add_command("analyze", "parallel", "memory, GPUs, FSDP degree and compute-bound batch of a large MLP stack",
                    cmd_analyze_parallel)  # fmt: skip
    p.add_argument("--d-model", type=_positive_int, default=16384, help="D")
    p.add_argument("--d-ff", type=_positive_int, default=53248, help="F")
    p.add_argument("--blocks", type=_positive_int, default=126, help="blocks of two linear layers")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences whose activations are saved")
    p.add_argument("--context", type=_positive_int, default=8192, help="tokens per sequence")
    p.add_argument("--gpu-memory-gb", type=_positive_float, default=80.0, help="GPU size for the count")
    p.add_argument("--device-memory-gb", type=_positive_float, default=95.0,
                   help="per-device limit for the FSDP degree (default: 95, TPU v5p)")  # fmt: skip
    p.add_argument("--w-ici", type=_positive_float, default=2 * 9e10,
                   help="W_ici, bidirectional ICI bytes/s per axis (default: 1.8e11, TPU v5p)")  # fmt: skip
    p.add_argument("--flops", type=_positive_float, default=4.6e14, help="C, FLOP/s per chip")
    p.add_argument("--mx", type=_positive_int, default=2, help="M_X, mesh axes of the FSDP dimension")
    p.add_argument("--my", type=_positive_int, default=1, help="M_Y, mesh axes of the TP dimension")
    p.add_argument("--x", type=_positive_int, default=16, help="X, FSDP degree")
    p.add_argument("--y", type=_positive_int, default=4, help="Y, TP degree")
    for name, description in (("attention", "scaled-dot-product attention, stage by stage"),
                              ("mha", "multi-head attention: projections, attention, output"),
                              ("mlp", "two-layer MLP D -> 4D -> D")):  # fmt: skip
        p = add_command("analyze", name, f"cost model of {description}", cmd_analyze_layer)
        p.add_argument("--batch", type=_positive_int, default=16, help="sequences B")
        p.add_argument("--seq", type=_positive_int, default=16384, help="sequence length N")
        p.add_argument("--d-model", type=_positive_int, default=4096, help="model width D")
        p.add_argument("--heads", type=_positive_int, default=32, help="attention heads H (not used by mlp)")
        p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp16", help="element type (bytes per element)")
        p.add_argument("--gpu", default="a100", choices=sorted(DEVICES), help=datasheet)

    def add_recall_arguments(p):
        p.add_argument("--keys", type=_positive_int, default=16, help="key vocabulary")
        p.add_argument("--values", type=_positive_int, default=16, help="value vocabulary")
        p.add_argument("--pairs", type=_positive_int, default=8, help="key-value pairs per sequence")
        p.add_argument("--train", type=_positive_int, default=8000, help="training sequences")
        p.add_argument("--test", type=_positive_int, default=1000, help="test sequences")
        p.add_argument("--seed", type=_seed, default=0, help="seed of the sequences and of the model's weights")

    add_group("train", "train the model on a task")
    p = add_command("train", "lm", "the LM on a byte-level text corpus, torch vs fastlm kernels: time, loss",
                    cmd_train_lm)  # fmt: skip
    p.add_argument("--data", type=_text_file, required=True, help="any UTF-8 text file (required)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="model preset (default small on a GPU, tiny "
                   "without one)")  # fmt: skip
    p.add_argument("--kernels", type=_choice_list(("torch", "fastlm"), "kernel set"), default=("torch", "fastlm"),
                   help="comma list of kernel sets, each from the same start")  # fmt: skip
    p.add_argument("--context", type=_positive_int, default=256, help="bytes per training window")
    p.add_argument("--batch", type=_positive_int, default=16, help="windows per step")
    p.add_argument("--epochs", type=_positive_int, default=1, help="passes over the training windows")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default bf16 on a GPU, fp32 on CPU")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the weights and of the batch order")
    p.add_argument("--compile", choices=COMPILE_MODES, default="eager",
                   help="eager, compile (torch.compile), or cudagraphs (torch.compile with "
                   "mode='reduce-overhead')")  # fmt: skip
    add_out(p)
    p = add_command("train", "ar", "associative recall: test accuracy per epoch, sweep over depth", cmd_train_ar)
    add_recall_arguments(p)
    p.add_argument("--layers", type=_int_list, default=(2,), help="comma list of depths, e.g. 1,2,3,4")
    p.add_argument("--epochs", type=_positive_int, default=50, help="passes over the training sequences per depth")
    p.add_argument("--d-model", type=_positive_int, default=64, help="model width (a multiple of --heads)")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--batch", type=_positive_int, default=64, help="sequences per step")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="AdamW learning rate")
    add_out(p)

    add_group("ar", "associative recall without training")
    add_recall_arguments(add_command("ar", "handcrafted", "score the hand-built two-layer attention model",
                                     cmd_ar_handcrafted))  # fmt: skip

    add_group("inspect", "look at generated code")
    p = add_command("inspect", "compiled-xent", "write the code torch.compile generates for cross-entropy",
                    cmd_inspect_compiled_xent)  # fmt: skip
    p.add_argument("--output", type=_output_file, default=Path("compiled_cross_entropy.py"), help="file to write")
    p = add_command("inspect", "autocast", "dtypes of a small model under fp16/bf16 autocast; fp16 vs fp32 sums",
                    cmd_inspect_autocast)  # fmt: skip
    p.add_argument("--terms", type=_positive_int, default=1000, help="terms of 0.01 in the accumulation demo")

    add_out(add_command(None, "report", "the main job: ceilings + every benchmark, written as a markdown report",
                        cmd_report))  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; 2 (after one sentence on stderr) for a mistake in how it was called."""
    args = build_parser().parse_args(argv)
    # torch.profiler's kineto logs every profiler start and stop to stderr at a severity only level 6
    # filters out: the profiling commands' piped output would be mostly that. A value set by the user
    # wins; worker processes inherit it.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        args.func(args)
        return 0
    except UserError as error:
        message = str(error)
    except (RuntimeError, MemoryError) as error:  # sizes the machine cannot hold are a user's mistake too
        from fastlm.bench.timing import is_out_of_memory

        if not is_out_of_memory(error):
            raise
        message = f"out of memory ({str(error).splitlines()[0][:160]}); try a smaller --batch, --context or model"
    command = " ".join(filter(None, ("fastlm", args.group, getattr(args, "command", None))))
    error_console.print(f"{command}: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
