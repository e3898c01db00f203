"""Which model a command runs or analyzes: presets (a comma list), dimensions that replace the
presets', and kernel switches. The preset, dimension and context options are the fields of
`fastlm.model.options.ModelOptions`, as in `fastlm train`."""

from __future__ import annotations

import argparse

from fastlm.cli.arguments import choice_list, positive_int
from fastlm.devices import current_device
from fastlm.model.config import PRESETS, ModelConfig
from fastlm.model.options import ModelOptions
from fastlm.settings import KERNEL_SETS, KERNEL_SETS_HELP, SWITCH_CHOICES
from fastlm.utils.errors import UserError
from fastlm.utils.options import add_options, from_namespace


def add_model_arguments(
    p: argparse.ArgumentParser,
    gpu_preset: str = "small",
    preset: str | None = None,
    batch_flags: tuple[str, ...] = ("--batch",),
    batch_help: str = "sequences per step",
    single: bool = False,
    attention_default: str = "the kernel set's",
) -> None:
    """Which model: presets (and dimensions replacing theirs), vocabulary, context, batch and kernel
    switches; ``gpu_preset`` is the default preset on a GPU machine (tiny without one), ``preset``
    the default on every machine instead (napkin math, which runs nothing). The batch
    (``args.batch``) is taken by ``batch_flags`` and described by ``batch_help``. ``single``: the
    command takes one model (`single_model_config`), so the help offers one preset and kernel set;
    ``attention_default`` says which attention runs without --attention."""
    p.set_defaults(gpu_preset=gpu_preset)
    listing = "one of" if single else "comma list of"
    presets = {
        "type": choice_list(PRESETS, "preset"),
        "choices": None,
        "help": f"{listing} {', '.join(PRESETS)} "
        + (f"(default: {preset})" if preset else f"(default on a GPU: {gpu_preset}; without one: tiny)"),
    }
    add_options(p, ModelOptions, overrides={"preset": presets})
    if preset:
        p.set_defaults(preset=(preset,))
    p.add_argument("--vocab", type=positive_int, default=10000, help="vocabulary size")
    metavar = batch_flags[0].lstrip("-").replace("-", "_").upper()
    p.add_argument(*batch_flags, dest="batch", metavar=metavar, type=positive_int, default=4, help=batch_help)
    p.add_argument(
        "--kernels",
        type=choice_list(KERNEL_SETS, "kernel set"),
        default=("torch",),
        help=f"{'one of' if single else 'comma list of'} {KERNEL_SETS_HELP}",
    )
    for switch, choices in SWITCH_CHOICES.items():  # one option per field of fastlm.settings.Kernels
        default = attention_default if switch == "attention" else "the kernel set's"
        what = "the softmax kernel of --attention naive" if switch == "softmax" else f"the {switch} kernel"
        p.add_argument(f"--{switch}", choices=choices, default=None, help=f"override {what} (default: {default})")


def check_heads(d_model: int, heads: int, rope: bool = False) -> None:
    """--d-model splits into --heads heads; with ``rope`` (the model, not a cost model) each head's
    width must be even too, since RoPE rotates pairs of dimensions."""
    if d_model % heads:
        raise UserError(f"--d-model ({d_model}) must be divisible by --heads ({heads})")
    if rope and (d_model // heads) % 2:
        raise UserError(
            f"--d-model / --heads ({d_model} / {heads} = {d_model // heads}) must be even: RoPE rotates "
            "pairs of dimensions"
        )


def model_configs(args: argparse.Namespace) -> list[tuple[str, ModelConfig]]:
    """(name, config) for every preset x kernel set named on the command line; a preset whose
    dimensions --d-model/--d-ff/--layers/--heads replace is named "custom"."""
    options = from_namespace(ModelOptions, args, preset=None)
    presets = args.preset or ((args.gpu_preset,) if current_device().type == "cuda" else ("tiny",))
    switches = {switch: getattr(args, switch) for switch in SWITCH_CHOICES}
    configs = []
    for preset in presets:
        base = options.model_config(preset, args.vocab)
        for kernels in args.kernels:
            try:
                configs.append(
                    (
                        "custom" if options.custom else preset,
                        base.with_kernels(kernels, **switches),
                    )
                )
            except ValueError as error:
                raise UserError(str(error)) from None
    return configs


def single_model_config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """The one (name, config) of `model_configs`, for commands that take a single model."""
    configs = model_configs(args)
    if len(configs) != 1:
        raise UserError(
            f"--preset and --kernels name {len(configs)} models (presets x kernel sets); "
            f"{args.group} {args.command} takes one"
        )
    return configs[0]
