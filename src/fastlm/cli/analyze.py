"""`fastlm analyze ...`: napkin math, printed as tables; the cost models in fastlm.analysis draw them.

Light on purpose: neither torch nor Triton is imported, so each command answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from fastlm.analysis.train_memory import COMPILE_MODES, PARALLEL_MODES
from fastlm.analysis.transformer import DTYPE_BYTES
from fastlm.cli import output
from fastlm.cli.arguments import add_command, add_compile_option, add_group, int_list, positive_float, positive_int
from fastlm.cli.models import add_model_arguments, check_heads, single_model_config
from fastlm.devices import DEVICES, device_spec
from fastlm.settings import BUCKETED_MODES, DEFAULT_BUCKET_MB, REDUCE_DTYPES, bucket_mb_in_use
from fastlm.train.config import TrainConfig
from fastlm.utils.errors import UserError


def cmd_analyze_xent(args) -> None:
    from fastlm.analysis.xent import CrossEntropyCost, cost_tables

    output.print_each(cost_tables(CrossEntropyCost(args.batch, args.vocab), device_spec(args.gpu)))


def cmd_analyze_conv1d(args) -> None:
    from fastlm.analysis.conv1d import Conv1dCost, cost_tables

    cost = Conv1dCost(
        args.batch,
        args.length,
        args.channels,
        args.kernel_size,
        DTYPE_BYTES[args.dtype],
        bias=not args.no_bias,
        silu=args.activation == "silu",
    )
    output.print_each(cost_tables(cost, args.dtype, device_spec(args.gpu)))


def cmd_analyze_memory(args) -> None:
    """`analyze memory`: the per-GPU peak memory and communication of a `fastlm train` step."""
    from fastlm.analysis.train_memory import TrainStep, memory_tables

    preset, config = single_model_config(args)
    if args.bucket_mb is not None and args.parallel not in BUCKETED_MODES:
        raise UserError(f"--bucket-mb sizes fsdp's sharding units: it needs --parallel fsdp, got {args.parallel}")
    try:
        step = TrainStep(
            dataclasses.replace(config, recompute=args.recompute),
            micro_batch=args.batch,
            gpus=args.gpus,
            parallel=args.parallel,
            compile=args.compile,
            accumulation=args.accumulation,
            bucket_mb=bucket_mb_in_use(args.parallel, args.bucket_mb) or DEFAULT_BUCKET_MB["fsdp"],
            reduce_dtype=args.reduce_dtype,
        )
    except ValueError as error:  # the fields named as the options that set them
        message = re.sub(r"\b(gpus|parallel|attention|window|mlp)\b", r"--\1", str(error))
        message = message.replace("reduce_dtype", "--reduce-dtype").replace("num_experts", "--experts")
        raise UserError(message) from None
    output.print_each(memory_tables(step, preset, args.contexts or ()))


def cmd_analyze_parallel(args) -> None:
    """`analyze parallel`: memory, GPUs, FSDP degree and compute-bound batch of a stack of MLP blocks."""
    from fastlm.analysis import parallel

    try:
        config = parallel.ParallelConfig(
            d_model=args.d_model, d_ff=args.d_ff, blocks=args.blocks, batch=args.batch, context_length=args.context
        )
        mesh = parallel.MeshConfig(w_ici=args.w_ici, flops=args.flops, m_x=args.mx, m_y=args.my, x=args.x, y=args.y)
    except ValueError as error:
        raise UserError(str(error)) from None
    output.print_each(parallel.cost_tables(config, mesh, args.gpu_memory_gb, args.device_memory_gb))


def cmd_analyze_layer(args) -> None:
    """`analyze attention|mha|mlp`: the per-stage cost table of one piece of a Transformer layer."""
    from fastlm.analysis.transformer import layer_tables

    if args.command != "mlp":
        check_heads(args.d_model, args.heads)
    spec = device_spec(args.gpu)
    output.print_each(layer_tables(args.command, args.batch, args.seq, args.d_model, args.heads, args.dtype, spec))


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "analyze", "napkin math: bytes, FLOPs, bound")
    datasheet = "datasheet to compare against"
    p = add_command(
        commands, "conv1d", "cost model of the depthwise causal conv1d (bytes, FLOPs, bound)", cmd_analyze_conv1d
    )
    p.add_argument("--batch", type=positive_int, default=1, help="sequences B")
    p.add_argument("--length", type=positive_int, default=8192, help="sequence length L")
    p.add_argument("--channels", type=positive_int, default=8192, help="channels D")
    p.add_argument("--kernel-size", type=positive_int, default=3, help="taps K")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp16", help="element type")
    p.add_argument("--activation", choices=("none", "silu"), default="none", help="fused activation")
    p.add_argument("--no-bias", action="store_true", help="no bias vector (default: with one)")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help=datasheet)
    p = add_command(commands, "xent", "cost model of fused cross-entropy", cmd_analyze_xent)
    p.add_argument("--batch", type=positive_int, default=4096, help="rows B (tokens)")
    p.add_argument("--vocab", type=positive_int, default=128256, help="vocabulary size V")
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help=datasheet)
    p = add_command(
        commands, "memory", "per-GPU peak memory and communication of a fastlm train step", cmd_analyze_memory
    )
    add_model_arguments(
        p,
        preset="2.7b",
        batch_flags=("--micro-batch", "--batch"),
        batch_help="sequences per GPU and micro-batch (--batch: the same)",
        single=True,
    )
    p.add_argument("--gpus", type=positive_int, default=1, help="processes, one per GPU (N)")
    p.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default="none",
        help="fastlm train --parallel: none (one process), ddp (each GPU holds all of the state) or fsdp (sharded)",
    )
    p.add_argument("--recompute", action="store_true", help="activation checkpointing, as fastlm train --recompute")
    p.add_argument(
        "--bucket-mb",
        type=positive_float,
        default=None,
        help=f"fsdp: the least MB of bf16 weights per sharding unit (default: {DEFAULT_BUCKET_MB['fsdp']:g}, "
        "fastlm train's)",
    )
    p.add_argument(
        "--accumulation", type=positive_int, default=1, help="micro-batches per optimizer step (gradient accumulation)"
    )
    p.add_argument(
        "--reduce-dtype",
        choices=REDUCE_DTYPES,
        default="fp32",
        help="fastlm train --reduce-dtype: the dtype gradients cross the wire in (bf16 halves the bytes)",
    )
    add_compile_option(p, COMPILE_MODES, "compile", note="default: compile, as fastlm train on a GPU")
    p.add_argument(
        "--contexts",
        type=int_list,
        default=None,
        help="also the predicted peak at each of these context lengths (default: none)",
    )
    p.set_defaults(batch=TrainConfig().micro_batch)  # fastlm train's micro-batch
    p = add_command(
        commands,
        "parallel",
        "memory, GPUs, FSDP degree and compute-bound batch of a large MLP stack",
        cmd_analyze_parallel,
    )
    p.add_argument("--d-model", type=positive_int, default=16384, help="D")
    p.add_argument("--d-ff", type=positive_int, default=53248, help="F")
    p.add_argument("--blocks", type=positive_int, default=126, help="blocks of two linear layers")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences whose activations are saved")
    p.add_argument("--context", type=positive_int, default=8192, help="tokens per sequence")
    p.add_argument("--gpu-memory-gb", type=positive_float, default=80.0, help="GPU size for the count")
    p.add_argument(
        "--device-memory-gb",
        type=positive_float,
        default=95.0,
        help="per-device limit for the FSDP degree (default: 95, TPU v5p)",
    )
    p.add_argument(
        "--w-ici",
        type=positive_float,
        default=2 * 9e10,
        help="W_ici, bidirectional ICI bytes/s per axis (default: 1.8e11, TPU v5p)",
    )
    p.add_argument("--flops", type=positive_float, default=4.6e14, help="C, FLOP/s per chip")
    p.add_argument("--mx", type=positive_int, default=2, help="M_X, mesh axes of the FSDP dimension")
    p.add_argument("--my", type=positive_int, default=1, help="M_Y, mesh axes of the TP dimension")
    p.add_argument("--x", type=positive_int, default=16, help="X, FSDP degree")
    p.add_argument("--y", type=positive_int, default=4, help="Y, TP degree")
    for name, description in (
        ("attention", "scaled-dot-product attention, stage by stage"),
        ("mha", "multi-head attention: projections, attention, output"),
        ("mlp", "two-layer MLP D -> 4D -> D"),
    ):
        p = add_command(commands, name, f"cost model of {description}", cmd_analyze_layer)
        p.add_argument("--batch", type=positive_int, default=16, help="sequences B")
        p.add_argument("--seq", type=positive_int, default=16384, help="sequence length N")
        p.add_argument("--d-model", type=positive_int, default=4096, help="model width D")
        p.add_argument("--heads", type=positive_int, default=32, help="attention heads H (not used by mlp)")
        p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp16", help="element type (bytes per element)")
        p.add_argument("--gpu", default="a100", choices=sorted(DEVICES), help=datasheet)
