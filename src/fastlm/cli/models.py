"""Which model a command runs or analyzes: presets or explicit dimensions, and kernel switches."""

from __future__ import annotations

import argparse
import dataclasses

from fastlm.cli.arguments import UserError, choice_list, positive_int
from fastlm.devices import current_device
from fastlm.model.config import (
    ATTENTION_KERNELS,
    KERNEL_SETS,
    LOSS_KERNELS,
    NORM_KERNELS,
    PRESETS,
    ROPE_KERNELS,
    SOFTMAX_KERNELS,
    ModelConfig,
)


def add_model_arguments(p: argparse.ArgumentParser, gpu_preset: str = "small") -> None:
    """Which model: presets (or explicit dims), vocabulary, context, batch and kernel switches;
    ``gpu_preset`` is the default preset on a GPU machine (tiny without one)."""
    p.set_defaults(gpu_preset=gpu_preset)
    p.add_argument("--preset", type=choice_list(PRESETS, "preset"), default=None,
                   help=f"comma list of {', '.join(PRESETS)} (default on a GPU: {gpu_preset}; "
                   "without one: tiny)")  # fmt: skip
    custom = "custom model instead of a preset, with --d-model, --d-ff, --layers and --heads (default: a preset)"
    p.add_argument("--d-model", type=positive_int, default=None, help=f"model width; {custom}")
    p.add_argument("--d-ff", type=positive_int, default=None, help=f"MLP hidden width; {custom}")
    p.add_argument("--layers", type=positive_int, default=None, help=f"Transformer blocks; {custom}")
    p.add_argument("--heads", type=positive_int, default=None, help=f"attention heads; {custom}")
    p.add_argument("--vocab", type=positive_int, default=10000, help="vocabulary size")
    p.add_argument("--context", type=positive_int, default=512, help="sequence length")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per step")
    p.add_argument("--kernels", type=choice_list(KERNEL_SETS, "kernel set"), default=("torch",),
                   help="comma list: torch (SDPA, PyTorch norm and loss) and/or fastlm (fused kernels)")  # fmt: skip
    kernel_default = "(default: the kernel set's)"
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default=None,
                   help=f"override the attention kernel {kernel_default}")  # fmt: skip
    p.add_argument("--norm", choices=NORM_KERNELS, default=None, help=f"override the norm kernel {kernel_default}")
    p.add_argument("--rope", choices=ROPE_KERNELS, default=None, help=f"override the RoPE kernel {kernel_default}")
    p.add_argument("--softmax", choices=SOFTMAX_KERNELS, default=None,
                   help=f"override the softmax kernel of --attention naive {kernel_default}")  # fmt: skip
    p.add_argument("--loss", choices=LOSS_KERNELS, default=None, help=f"override the loss kernel {kernel_default}")


def check_heads(d_model: int, heads: int, rope: bool = False) -> None:
    """--d-model splits into --heads heads; with ``rope`` (the model, not a cost model) each head's
    width must be even too, since RoPE rotates pairs of dimensions."""
    if d_model % heads:
        raise UserError(f"--d-model ({d_model}) must be divisible by --heads ({heads})")
    if rope and (d_model // heads) % 2:
        raise UserError(f"--d-model / --heads ({d_model} / {heads} = {d_model // heads}) must be even: RoPE rotates "
                        "pairs of dimensions")  # fmt: skip


def model_configs(args: argparse.Namespace) -> list[tuple[str, ModelConfig]]:
    """(name, config) for every preset x kernel set named on the command line; explicit
    --d-model/--d-ff/--layers/--heads build one "custom" config instead of presets."""
    common = {"vocab_size": args.vocab, "context_length": args.context}
    dims = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads}
    if any(v is not None for v in dims.values()):
        missing = [f"--{k.replace('num_', '').replace('_', '-')}" for k, v in dims.items() if v is None]
        if missing:
            raise UserError(
                f"a custom model needs --d-model, --d-ff, --layers and --heads; missing {', '.join(missing)}"
            )
        check_heads(args.d_model, args.heads, rope=True)
        bases = [("custom", lambda: ModelConfig(**dims, **common))]
    else:
        presets = args.preset or ((args.gpu_preset,) if current_device().type == "cuda" else ("tiny",))
        bases = [(name, lambda name=name: ModelConfig.preset(name, **common)) for name in presets]
    overrides = {
        k: getattr(args, k) for k in ("attention", "norm", "rope", "loss", "softmax") if getattr(args, k) is not None
    }
    configs = []
    for name, make in bases:
        for kernels in args.kernels:
            try:
                configs.append((name, dataclasses.replace(make().with_kernels(kernels), **overrides)))
            except ValueError as error:
                raise UserError(str(error)) from None
    return configs


def single_model_config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """The one (name, config) of `model_configs`, for commands that take a single model."""
    configs = model_configs(args)
    if len(configs) != 1:
        raise UserError(f"--preset and --kernels name {len(configs)} models (presets x kernel sets); "
                        f"{args.group} {args.command} takes one")  # fmt: skip
    return configs[0]
