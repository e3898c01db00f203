"""`fastlm bench hf`: a Hugging Face model's training step unpatched, patched by fastlm and by Liger."""

from __future__ import annotations

import argparse
import importlib.util
from typing import TYPE_CHECKING

from fastlm.analysis.model import MODES
from fastlm.bench.options import HF_FAMILIES, HF_PATCH_CHOICES, HF_PATCHES, HF_SIZES
from fastlm.cli import output
from fastlm.cli.arguments import (
    add_command,
    add_compile_option,
    add_out,
    add_precision_option,
    choice_list,
    non_negative_int,
    positive_int,
)
from fastlm.devices import current_device
from fastlm.settings import COMPILE_MODES, FP32_WEIGHT_PRECISIONS, STATE_BYTES, default_precision
from fastlm.utils.errors import UserError
from fastlm.utils.host_memory import check_fits_host

if TYPE_CHECKING:  # fastlm.bench.hf imports torch, which `fastlm --help` does not
    from fastlm.bench.hf import HFShape


def cmd_bench_hf(args) -> None:
    if importlib.util.find_spec("transformers") is None:
        raise UserError("fastlm bench hf needs the transformers package: pip install 'fastlm[hf]'")
    from fastlm.bench.hf import HFBenchmark, HFShape, smallest_size
    from fastlm.bench.model import rows
    from fastlm.harness.runner import run_benchmark

    on_gpu = current_device().type == "cuda"
    size = args.size or (smallest_size(args.family) if on_gpu else "tiny")
    context = args.seq or (2048 if on_gpu else 64)
    overrides = {
        "num_layers": args.layers,
        "d_model": args.d_model,
        "d_ff": args.d_ff,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab,
    }
    try:
        shape = HFShape.of(args.family, size, context, **overrides)
    except ValueError as error:
        raise UserError(str(error)) from None
    if not on_gpu:
        _check_fits_host(shape, len(args.patches))
    compile_modes = args.compile or (("eager", "compile") if on_gpu else ("eager",))
    benchmark = HFBenchmark(
        (shape,),
        args.patches,
        tuple(rows(args.mode, args.precision or (default_precision(on_gpu),), compile_modes)),
        batch=args.batch or (4 if on_gpu else 1),
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
    )
    output.show_report(run_benchmark(benchmark, args.out, current_device()))


def _check_fits_host(shape: HFShape, models: int) -> None:
    """On a CPU, stop before building ``models`` models (interleaved rounds keep them all) whose fp32
    weights, gradients and AdamW moments (`STATE_BYTES`) would not fit the host."""
    parameters = shape.num_parameters()
    check_fits_host(
        STATE_BYTES["fp32"].total * parameters * models,
        f"the training state of {models} model(s) of {shape.family} {shape.size} ({parameters / 1e9:.2f}B "
        "parameters each: fp32 weights, gradients and AdamW moments)",
        "use --size tiny, or fewer --layers and a smaller --d-model and --vocab",
    )


def add_commands(commands: argparse._SubParsersAction) -> None:
    p = add_command(
        commands,
        "hf",
        "a Hugging Face model's training step: unpatched, fastlm.apply_fastlm, Liger (tokens/s, MFU, peak memory)",
        cmd_bench_hf,
        duration=("about 15 seconds", "3-6 minutes at 1b, plus 1-3 minutes of compilation per model"),
    )
    p.add_argument("--family", choices=HF_FAMILIES, default="llama", help="model family (default llama)")
    p.add_argument(
        "--size",
        choices=HF_SIZES,
        default=None,
        help="the family's published dimensions: 1b, 3b, 8b (Llama 3.2 1B/3B, 3.1 8B; Qwen3 1.7B/4B/8B; "
        "Mistral 7B as 8b; OLMo 2 1B; Gemma 3 1B; Phi-3-mini, Granite 3 2B, SmolLM3 3B, Gemma 2 2B as 3b; "
        "Qwen3-30B-A3B as a3b, "
        "4 of its 48 layers, unpatched with transformers' grouped_mm experts) or tiny (default: the "
        "family's smallest on a GPU, tiny on a CPU)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="number of layers (default: the size's; fewer make a quick run)",
    )
    for flag, what in (
        ("--d-model", "hidden size"),
        ("--d-ff", "MLP width"),
        ("--heads", "query heads"),
        ("--kv-heads", "key/value heads"),
        ("--head-dim", "head dimension"),
        ("--vocab", "vocabulary size"),
    ):
        p.add_argument(flag, type=positive_int, default=None, help=f"{what} (default: the size's)")
    p.add_argument(
        "--batch", type=positive_int, default=None, help="sequences per step (default 4 on a GPU, 1 on a CPU)"
    )
    p.add_argument(
        "--seq", type=positive_int, default=None, help="tokens per sequence (default 2048 on a GPU, 64 on a CPU)"
    )
    p.add_argument(
        "--patches",
        type=choice_list(HF_PATCH_CHOICES, "patch"),
        default=HF_PATCHES,
        help="comma list of none (the model as it is), fastlm, liger, fastlm-fp8 (apply_fastlm with "
        "fp8=True) (default none,fastlm,liger; liger is reported missing when not installed)",
    )
    p.add_argument(
        "--mode",
        type=choice_list(MODES, "mode"),
        default=("train",),
        help="comma list of fwd, fwd+bwd, train (default train: forward, backward, fused AdamW)",
    )
    add_precision_option(p, FP32_WEIGHT_PRECISIONS, many=True, note="default: bf16 on a GPU, fp32 without one")
    add_compile_option(p, COMPILE_MODES[:2], many=True, note="default: both on a GPU, eager on a CPU")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps first, every round (default 3)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per round (default 10)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="interleaved rounds; the median over rounds is reported with its spread (default 3)",
    )
    add_out(p)
