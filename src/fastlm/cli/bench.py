"""`fastlm bench ...`: measure ops, the model and data-parallel training against their baselines.

Each benchmark runs through `fastlm.harness.runner`: records under <out>/results, a markdown report
under <out>/reports, then the report printed.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from rich.table import Table

from fastlm.bench.options import (
    ATTENTION_SWEEPS,
    HOST_COMPILE_MODES,
    HOST_CPU_CALLS,
    HOST_CPU_ROUNDS,
    HOST_GPU_CALLS,
    HOST_GPU_ROUNDS,
    HOST_MIN_ROUNDS,
    HOST_OPS,
    MOE_LAYERS,
    MOE_TOKENS,
)
from fastlm.cli import bench_distributed, bench_hf, output
from fastlm.cli.arguments import (
    add_command,
    add_compile_option,
    add_group,
    add_out,
    add_precision_option,
    choice_list,
    int_list,
    non_negative_int,
    positive_int,
)
from fastlm.cli.models import add_model_arguments, model_configs
from fastlm.cli.train import add_kernel_comparison_arguments
from fastlm.devices import current_device
from fastlm.model.config import PRESETS
from fastlm.settings import CUDAGRAPHS_NEED_A_GPU, ONE_MODEL_PRECISIONS, default_precision
from fastlm.utils.errors import UserError

_host_ops = choice_list(HOST_OPS, "op")
_sweep_list = choice_list(ATTENTION_SWEEPS, "sweep")
_moe_layers = choice_list(MOE_LAYERS, "layer")


def _rounds(text: str) -> int:
    value = positive_int(text)
    if value < HOST_MIN_ROUNDS:
        raise argparse.ArgumentTypeError(
            f"expected at least {HOST_MIN_ROUNDS} rounds (a median and a spread), got {value}"
        )
    return value


def cmd_bench_ceilings(args) -> None:
    from fastlm.harness.ceilings import RESULTS_FILE, record_ceilings

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
    table.add_row(
        f"{record['copy_gbps']:.3g}", f"{record['matmul_tflops']:.3g}", f"{shape} {record['matmul_dtype']}", datasheet
    )
    output.console.print(table)
    output.console.print(f"[bold]wrote[/] {args.out / 'results' / RESULTS_FILE}")


def _run(benchmark, out: Path) -> None:
    """Measure ``benchmark`` (a `fastlm.harness.benchmark.Benchmark`) on this device, write its records
    and report under ``out`` and print the report."""
    from fastlm.harness.runner import run_benchmark

    output.show_report(run_benchmark(benchmark, out, current_device()))


def _fixed(module: str, benchmark: str) -> Callable[[argparse.Namespace], None]:
    """The handler of a benchmark whose only option is --out: ``benchmark``, a class of ``module``
    (imported when the command runs: building the parser imports no torch)."""

    def handler(args: argparse.Namespace) -> None:
        _run(getattr(importlib.import_module(module), benchmark)(), args.out)

    return handler


def cmd_bench_xent(args) -> None:
    from fastlm.bench.xent import DEFAULT_VOCABS, CrossEntropyBenchmark

    _run(CrossEntropyBenchmark(args.batch, args.vocab or DEFAULT_VOCABS), args.out)


def cmd_bench_host(args) -> None:
    from fastlm.bench.host import HostBenchmark

    _run(HostBenchmark(args.ops, args.compile, args.rounds, args.calls), args.out)


def cmd_bench_moe(args) -> None:
    from fastlm.bench.moe import MoEBenchmark

    _run(MoEBenchmark(args.layers, args.tokens), args.out)


def cmd_bench_attention(args) -> None:
    from fastlm.bench.attention import AttentionBenchmark

    _run(AttentionBenchmark(args.sweep), args.out)


def _check_hf_installed() -> None:
    """--hf compares with transformers' Llama: a clear sentence when it is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("--hf needs the transformers package: pip install transformers") from None


def cmd_bench_model(args) -> None:
    from fastlm.analysis.model import MODES
    from fastlm.bench.model import SWEEP_COMPILE_MODES, SWEEP_PRECISIONS, ModelBenchmark, rows

    if args.sweep:
        args.preset = args.preset or tuple(p for p in PRESETS if p != "tiny")
        args.mode, args.precision, args.compile = (
            args.mode or MODES,
            args.precision or SWEEP_PRECISIONS,
            args.compile or SWEEP_COMPILE_MODES,
        )
    import torch

    precision = default_precision(torch.cuda.is_available())
    row_list = rows(args.mode or ("train",), args.precision or (precision,), args.compile or ("eager",))
    if not args.sweep and "cudagraphs" in (args.compile or ()):
        if not torch.cuda.is_available():
            raise UserError(CUDAGRAPHS_NEED_A_GPU)
    configs = model_configs(args)
    if args.hf:
        _check_hf_installed()
    _run(
        ModelBenchmark(
            tuple(configs),
            tuple(row_list),
            batch=args.batch,
            warmup=args.warmup,
            steps=args.steps,
            rounds=args.rounds,
            interleave=args.interleave,
            hf=args.hf,
        ),
        args.out,
    )


def cmd_bench_train(args) -> int:
    from fastlm.bench import train_kernels

    return train_kernels.run(args)


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "bench", "measure ops against their baselines")
    p = add_command(
        commands,
        "ceilings",
        "measured copy GB/s and matmul TFLOP/s (bf16 on a GPU, fp32 on a CPU) of this device",
        cmd_bench_ceilings,
    )
    add_out(p)
    p = add_command(
        commands,
        "xent",
        "cross-entropy fwd/bwd vs eager, compile, Liger",
        cmd_bench_xent,
        duration=("about a minute", "under 10 minutes"),
    )
    p.add_argument("--batch", type=positive_int, default=None, help="rows (default 4096 on a GPU, 128 on a CPU)")
    p.add_argument(
        "--vocab", type=int_list, default=None, help="comma list of vocabulary sizes (default 32000,50264,128256)"
    )
    add_out(p)
    p = add_command(
        commands,
        "attention",
        "attention: naive vs torch.compile vs fastlm vs SDPA flash/cuDNN",
        cmd_bench_attention,
        duration=("about 30 seconds", "under 10 minutes"),
    )
    p.add_argument(
        "--sweep",
        type=_sweep_list,
        default=("model",),
        help=f"comma list of sweeps among {', '.join(ATTENTION_SWEEPS)}",
    )
    add_out(p)
    p = add_command(
        commands,
        "moe",
        "mixture-of-experts experts fwd, fwd+bwd: ms, active TFLOP/s, peak memory vs transformers' eager loop, "
        "grouped_mm, grouped_mm compiled",
        cmd_bench_moe,
        duration=("about 20 seconds", "about 8 minutes"),
    )
    p.add_argument(
        "--layers",
        type=_moe_layers,
        default=MOE_LAYERS,
        help=f"comma list of layer shapes among {', '.join(MOE_LAYERS)} (a GPU run; default all)",
    )
    p.add_argument(
        "--tokens",
        type=int_list,
        default=MOE_TOKENS,
        help=f"comma list of token counts (a GPU run; default {','.join(map(str, MOE_TOKENS))})",
    )
    add_out(p)
    ten_seconds = ("about 10 seconds", "under 10 minutes")
    # the benchmarks whose only option is --out
    for name, summary, handler, duration in (
        (
            "norms",
            "LayerNorm / RMSNorm fwd, bwd, fwd+bwd vs eager, compile, Liger",
            _fixed("fastlm.bench.norms", "NormsBenchmark"),
            ten_seconds,
        ),
        (
            "softmax",
            "masked softmax fwd, bwd, fwd+bwd vs eager, compile",
            _fixed("fastlm.bench.softmax", "SoftmaxBenchmark"),
            ten_seconds,
        ),
        (
            "swiglu",
            "SwiGLU silu(gate) * up fwd, bwd, fwd+bwd vs eager, compile, Liger",
            _fixed("fastlm.bench.swiglu", "SwigluBenchmark"),
            ten_seconds,
        ),
        (
            "conv1d",
            "causal conv1d fwd, bwd, fwd+bwd vs eager, compile, CUDA C++ forward",
            _fixed("fastlm.bench.conv1d", "Conv1dBenchmark"),
            ten_seconds,
        ),
        (
            "linear-xent",
            "fused linear + cross-entropy fwd+bwd: ms, TFLOP/s, peak memory vs eager, compile, "
            "matmul + fastlm CE, Liger, CCE",
            _fixed("fastlm.bench.linear_xent", "LinearCrossEntropyBenchmark"),
            None,
        ),
        (
            "dpo",
            "DPO loss from hidden states fwd+bwd: ms, TFLOP/s, peak memory vs eager, compile, Liger",
            _fixed("fastlm.bench.dpo", "DPOBenchmark"),
            None,
        ),
        (
            "roofline",
            "this device's measured roofline with every benchmarked fastlm kernel on it",
            _fixed("fastlm.bench.roofline", "RooflineBenchmark"),
            None,
        ),
    ):
        add_out(add_command(commands, name, summary, handler, duration=duration))
    p = add_command(
        commands,
        "host",
        "host (CPU) time per call of each op vs the PyTorch op it replaces, at small shapes where the host dominates",
        cmd_bench_host,
        duration=("about 10 seconds", "under 10 minutes"),
    )
    p.add_argument("--ops", type=_host_ops, default=None, help=f"comma list among {','.join(HOST_OPS)} (default all)")
    add_compile_option(
        p, HOST_COMPILE_MODES, ("eager",), many=True, note="default: eager; fullgraph, each implementation, fwd and bwd"
    )
    p.add_argument(
        "--rounds",
        type=_rounds,
        default=None,
        help=f"rounds, each timing every implementation and direction (default {HOST_GPU_ROUNDS} on a "
        f"GPU, {HOST_CPU_ROUNDS} without one; at least {HOST_MIN_ROUNDS})",
    )
    p.add_argument(
        "--calls",
        type=positive_int,
        default=None,
        help=f"calls per round and timing (default {HOST_GPU_CALLS} on a GPU, {HOST_CPU_CALLS} without one)",
    )
    add_out(p)
    _add_model_command(commands)
    bench_hf.add_commands(commands)
    bench_distributed.add_commands(commands)


def _add_model_command(commands: argparse._SubParsersAction) -> None:
    p = add_command(
        commands,
        "model",
        "LM step time, tokens/s, MFU, peak memory (fwd, fwd+bwd, train)",
        cmd_bench_model,
        duration=(
            "about 25 seconds",
            "under 10 minutes, plus 2-4 minutes of compilation per large model and compile mode",
        ),
    )
    add_model_arguments(p)
    p.add_argument(
        "--mode",
        type=choice_list(("fwd", "fwd+bwd", "train"), "mode"),
        default=None,
        help="comma list of fwd, fwd+bwd, train (default train)",
    )
    add_precision_option(p, ONE_MODEL_PRECISIONS, many=True, note="default: bf16 on a GPU, fp32 without one")
    add_compile_option(p, many=True, note="default: eager; the sweep: eager, compile")
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first, every round")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per round")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="rounds of warm-up + timed steps per row; the median over rounds is reported, with "
        "the lowest and highest round's",
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="round 1 of every row, then round 2, ..., every model kept (default: when the "
        "models fit in memory together; else each row's rounds back to back)",
    )
    p.add_argument(
        "--sweep", action="store_true", help="every preset but tiny x fwd, fwd+bwd, train x fp32, bf16 x eager, compile"
    )
    p.add_argument("--hf", action="store_true", help="also measure transformers' LlamaForCausalLM of the same dims")
    add_out(p)
    p = add_command(
        commands,
        "train",
        "the training loop of fastlm train once per kernel set, from the same start: time, tokens/s, MFU, loss curves",
        cmd_bench_train,
        duration=("about 10 minutes", "under 10 minutes"),
    )
    add_kernel_comparison_arguments(p)
