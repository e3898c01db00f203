"""`fastlm bench ...`: measure ops, the model and data-parallel training against their baselines.

Each benchmark writes records under <out>/results and a markdown report under <out>/reports,
then prints the report. The `run_*` functions are shared with `fastlm report`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from fastlm.bench.options import (
    ATTENTION_SWEEPS,
    HOST_COMPILE_MODES,
    HOST_CPU_CALLS,
    HOST_CPU_ROUNDS,
    HOST_CPU_WARMUP,
    HOST_GPU_CALLS,
    HOST_GPU_ROUNDS,
    HOST_GPU_WARMUP,
    HOST_MIN_ROUNDS,
    HOST_OPS,
)
from fastlm.cli import bench_distributed, output
from fastlm.cli.arguments import (
    UserError,
    add_command,
    add_group,
    add_out,
    choice_list,
    int_list,
    non_negative_int,
    positive_int,
)
from fastlm.cli.models import add_model_arguments, model_configs
from fastlm.devices import current_device
from fastlm.model.config import COMPILE_MODES, PRESETS

_host_ops = choice_list(HOST_OPS, "op")
_sweep_list = choice_list(ATTENTION_SWEEPS, "sweep")


def _rounds(text: str) -> int:
    value = positive_int(text)
    if value < HOST_MIN_ROUNDS:
        raise argparse.ArgumentTypeError(f"expected at least {HOST_MIN_ROUNDS} rounds (a median and a spread), "
                                         f"got {value}")  # fmt: skip
    return value


def cmd_bench_ceilings(args) -> None:
    from fastlm.harness.ceilings import record_ceilings

    record = record_ceilings(args.out / "results", current_device())
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
    output.console.print(table)


def run_xent_benchmark(out: Path, batch: int | None, vocabs: tuple[int, ...] | None) -> Path:
    """Ceilings, then the cross-entropy sweep, then its markdown report; returns the report path."""
    from fastlm.bench import xent
    from fastlm.harness.ceilings import record_ceilings

    device = current_device()
    if batch is None:
        batch = xent.DEFAULT_BATCH if device.type == "cuda" else xent.CPU_BATCH
    vocabs = vocabs or xent.DEFAULT_VOCABS
    results_dir, reports_dir = out / "results", out / "reports"
    output.note_without_gpu(device, xent.CPU_NOTE)
    ceilings = record_ceilings(results_dir, device)
    with output.progress_steps("cross-entropy", len(vocabs) * len(xent.IMPLEMENTATIONS)) as step:
        xent.run(batch=batch, vocabs=vocabs, device=device, ceilings=ceilings, results_dir=results_dir, progress=step)
    report = output.write_report(
        reports_dir / "xent.md", "Cross-entropy benchmark", xent.render(results_dir, reports_dir)
    )
    return report


def cmd_bench_xent(args) -> None:
    report = run_xent_benchmark(args.out, args.batch, args.vocab)
    output.show_report(report)


def run_bandwidth_benchmark(out: Path, module, name: str, title: str) -> Path:
    """`bench norms | softmax | conv1d`: copy ceiling, every case x implementation; the report's path."""
    from fastlm.bench.bandwidth import CPU_NOTE
    from fastlm.harness.ceilings import record_ceilings

    device = current_device()
    output.note_without_gpu(device, CPU_NOTE)
    results_dir, reports_dir = out / "results", out / "reports"
    ceilings = record_ceilings(results_dir, device)
    with output.progress_steps(name, len(module.cases(device)) * len(module.IMPLEMENTATIONS)) as step:
        module.run(device, ceilings, results_dir, progress=step)
    return output.write_report(reports_dir / f"{name}.md", title, module.render(results_dir, reports_dir))


def cmd_bench_norms(args) -> None:
    from fastlm.bench import norms

    output.show_report(run_bandwidth_benchmark(args.out, norms, "norms", "LayerNorm / RMSNorm benchmark"))


def cmd_bench_softmax(args) -> None:
    from fastlm.bench import softmax

    output.show_report(run_bandwidth_benchmark(args.out, softmax, "softmax", "Masked softmax benchmark"))


def run_roofline(out: Path) -> Path:
    """The roofline report from the results under ``out``, with this device's latest ceilings."""
    from fastlm.bench import roofline
    from fastlm.devices import current_device_name
    from fastlm.harness.ceilings import RESULTS_FILE, record_ceilings
    from fastlm.harness.records import read_records

    results_dir, reports_dir = out / "results", out / "reports"
    output.note_without_gpu(current_device(), roofline.CPU_NOTE)
    here = [r for r in read_records(results_dir / RESULTS_FILE) if r["gpu"] == current_device_name()]
    ceilings = here[-1] if here else record_ceilings(results_dir, current_device())  # the kernels' own run's ceilings
    return output.write_report(
        reports_dir / "roofline.md", "Roofline", roofline.render(results_dir, reports_dir, ceilings)
    )


def cmd_bench_roofline(args) -> None:
    output.show_report(run_roofline(args.out))


def cmd_bench_conv1d(args) -> None:
    from fastlm.bench import conv1d

    output.show_report(run_bandwidth_benchmark(args.out, conv1d, "conv1d", "Causal conv1d benchmark"))


def cmd_bench_linear_xent(args) -> None:
    from fastlm.bench import linear_xent

    title = "Fused linear + cross-entropy benchmark"
    output.show_report(run_bandwidth_benchmark(args.out, linear_xent, "linear_xent", title))


def run_host_benchmark(
    out: Path, ops: Sequence[str] | None, modes: Sequence[str], rounds: int | None, calls: int | None
) -> Path:
    """Host cost per call of each op vs its PyTorch op (`fastlm.bench.host`); returns the report path.
    ``None`` picks all ops, and the rounds and calls of this device (fewer on CPU)."""
    from fastlm.bench import host

    device = current_device()
    on_gpu = device.type == "cuda"
    cases = [host.CASES[name] for name in (ops or HOST_OPS)]
    output.note_without_gpu(device, host.CPU_NOTE)
    with output.progress_steps("host cost", len(cases) * len(modes)) as step:
        host.run(cases, modes, device, out / "results", progress=step,
                 rounds=rounds or (HOST_GPU_ROUNDS if on_gpu else HOST_CPU_ROUNDS),
                 calls=calls or (HOST_GPU_CALLS if on_gpu else HOST_CPU_CALLS),
                 warmup=HOST_GPU_WARMUP if on_gpu else HOST_CPU_WARMUP)  # fmt: skip
    body = host.render(out / "results", out / "reports")
    return output.write_report(out / "reports" / "host.md", "Host cost per call: fastlm vs PyTorch", body)


def cmd_bench_host(args) -> None:
    output.show_report(run_host_benchmark(args.out, args.ops, args.compile, args.rounds, args.calls))


def run_attention_benchmark(out: Path, sweeps: tuple[str, ...]) -> Path:
    """The attention sweeps, then their markdown report; returns the report path."""
    from fastlm.bench import attention

    device = current_device()
    output.note_without_gpu(device, attention.CPU_NOTE)
    results_dir, reports_dir = out / "results", out / "reports"
    with output.progress_steps("attention", attention.total_measurements(sweeps, device)) as step:
        attention.run(sweeps, device, results_dir, progress=step)
    return output.write_report(
        reports_dir / "attention.md", "Attention benchmark", attention.render(results_dir, reports_dir)
    )


def cmd_bench_attention(args) -> None:
    report = run_attention_benchmark(args.out, args.sweep)
    output.show_report(report)


def run_model_benchmark(
    out: Path, configs, rows, *, batch: int, warmup: int, steps: int, hf: bool, rounds: int = 1,
    interleave: bool | None = None,
) -> Path:  # fmt: skip
    """Measure the model rows for ``rounds`` rounds (interleaved across configurations unless
    ``interleave`` is False, or None and the models would not fit in memory together), then write
    their markdown report; returns the report path."""
    from fastlm.bench import model as model_bench

    device = current_device()
    implementations = model_bench.IMPLEMENTATIONS if hf else ("fastlm",)
    if hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise UserError("--hf needs the transformers package: pip install transformers") from None
    results_dir, reports_dir = out / "results", out / "reports"
    output.note_without_gpu(device, model_bench.CPU_NOTE)
    with output.progress_steps(
        "model", len(model_bench.subjects(configs, implementations)) * len(rows) * rounds
    ) as step:
        model_bench.run(configs, rows, batch=batch, warmup=warmup, steps=steps, device=device,
                        results_dir=results_dir, implementations=implementations, rounds=rounds,
                        interleave=interleave, progress=step)  # fmt: skip
    report = output.write_report(
        reports_dir / "model.md", "Model benchmark", model_bench.render(results_dir, reports_dir)
    )
    return report


def cmd_bench_model(args) -> None:
    from fastlm.analysis.model import MODES
    from fastlm.bench.model import PRECISIONS, SWEEP_COMPILE_MODES, rows

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
    output.show_report(report)


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "bench", "measure ops against their baselines")
    p = add_command(commands, "ceilings", "measured copy GB/s and matmul TFLOP/s (bf16 on a GPU, fp32 on a CPU) of "
                    "this device", cmd_bench_ceilings)  # fmt: skip
    add_out(p)
    p = add_command(commands, "xent", "cross-entropy fwd/bwd vs eager, compile, Liger", cmd_bench_xent,
                    duration=("about a minute", "under 10 minutes"))  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=None, help="rows (default 4096 on a GPU, 128 on a CPU)")
    p.add_argument("--vocab", type=int_list, default=None,
                   help="comma list of vocabulary sizes (default 32000,50264,128256)")  # fmt: skip
    add_out(p)
    p = add_command(commands, "attention", "attention: naive vs torch.compile vs fastlm vs SDPA flash/cuDNN",
                    cmd_bench_attention, duration=("about 10 seconds", "under 10 minutes"))  # fmt: skip
    p.add_argument("--sweep", type=_sweep_list, default=("model",),
                   help=f"comma list of sweeps among {', '.join(ATTENTION_SWEEPS)}")  # fmt: skip
    add_out(p)
    ten_seconds = ("about 10 seconds", "under 10 minutes")
    # the benchmarks whose only option is --out
    for name, summary, handler, duration in (
        ("norms", "LayerNorm / RMSNorm fwd, bwd, fwd+bwd vs eager, compile, Liger", cmd_bench_norms, ten_seconds),
        ("softmax", "masked softmax fwd, bwd, fwd+bwd vs eager, compile", cmd_bench_softmax, ten_seconds),
        ("conv1d", "causal conv1d fwd, bwd, fwd+bwd vs eager, compile, CUDA C++ forward", cmd_bench_conv1d,
         ten_seconds),
        ("linear-xent", "fused linear + cross-entropy fwd+bwd: ms, TFLOP/s, peak memory vs eager, compile, "
         "matmul + fastlm CE, Liger, CCE", cmd_bench_linear_xent, None),
        ("roofline", "this device's measured roofline with every benchmarked fastlm kernel on it", cmd_bench_roofline,
         None),
    ):  # fmt: skip
        add_out(add_command(commands, name, summary, handler, duration=duration))
    p = add_command(commands, "host", "host (CPU) time per call of each op vs the PyTorch op it replaces, at small "
                    "shapes where the host dominates", cmd_bench_host,
                    duration=("about 20 seconds", "under 10 minutes"))  # fmt: skip
    p.add_argument("--ops", type=_host_ops, default=None, help=f"comma list among {','.join(HOST_OPS)} (default all)")
    p.add_argument("--compile", type=choice_list(HOST_COMPILE_MODES, "compile mode"), default=("eager",),
                   help="comma list of eager, compile (torch.compile(fullgraph=True) of each implementation, "
                   "fwd and bwd)")  # fmt: skip
    p.add_argument("--rounds", type=_rounds, default=None,
                   help=f"rounds, each timing every implementation and direction (default {HOST_GPU_ROUNDS} on a "
                   f"GPU, {HOST_CPU_ROUNDS} without one; at least {HOST_MIN_ROUNDS})")  # fmt: skip
    p.add_argument("--calls", type=positive_int, default=None,
                   help=f"calls per round and timing (default {HOST_GPU_CALLS} on a GPU, {HOST_CPU_CALLS} without "
                   "one)")  # fmt: skip
    add_out(p)
    _add_model_command(commands)
    bench_distributed.add_commands(commands)


def _add_model_command(commands: argparse._SubParsersAction) -> None:
    p = add_command(commands, "model", "LM step time, tokens/s, MFU, peak memory (fwd, fwd+bwd, train)",
                    cmd_bench_model, duration=("about 15 seconds", "under 10 minutes, plus 2-4 minutes of "
                                               "compilation per large model and compile mode"))  # fmt: skip
    add_model_arguments(p)
    p.add_argument("--mode", type=choice_list(("fwd", "fwd+bwd", "train"), "mode"), default=None,
                   help="comma list of fwd, fwd+bwd, train (default train)")  # fmt: skip
    p.add_argument("--precision", type=choice_list(("fp32", "bf16"), "precision"), default=None,
                   help="comma list of fp32, bf16 (autocast) (default bf16)")  # fmt: skip
    p.add_argument("--compile", type=choice_list(COMPILE_MODES, "compile mode"), default=None,
                   help="comma list of eager, compile (torch.compile), cudagraphs (torch.compile with "
                   "mode='reduce-overhead') (default eager; the sweep: eager, compile)")  # fmt: skip
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first, every round")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per round")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds of warm-up + timed steps per row; the median over rounds is reported, with "
                   "the lowest and highest round's")  # fmt: skip
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="round 1 of every row, then round 2, ..., every model kept (default: when the "
                   "models fit in memory together; else each row's rounds back to back)")  # fmt: skip
    p.add_argument("--sweep", action="store_true",
                   help="every preset but tiny x fwd, fwd+bwd, train x fp32, bf16 x eager, compile")  # fmt: skip
    p.add_argument("--hf", action="store_true", help="also measure transformers' LlamaForCausalLM of the same dims")
    add_out(p)
