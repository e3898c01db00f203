"""How commands and their options are declared: argument types, groups, commands, --out.

Each argument type rejects a bad value with one sentence, which argparse prefixes with the
option's name ("argument --lr: expected a positive finite number, got 'nan'") and exits with 2.
A mistake argparse cannot see (options that contradict each other) raises
`fastlm.utils.errors.UserError`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from fastlm.settings import COMPILE_MEANINGS, COMPILE_MODES, PRECISION_MEANINGS, PRECISIONS, choices_help
from fastlm.utils.options import SEED_LIMIT
from fastlm.utils.paths import check_writable_folder

# ---------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None


def random_seed(text: str) -> int:
    """A random seed: an integer in [0, SEED_LIMIT), as `fastlm train --seed` takes."""
    value = non_negative_int(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a seed below 2**63, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def comma_list(parse_one: Callable[[str], object], what: str) -> Callable[[str], tuple]:
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


int_list = comma_list(positive_int, "positive integers")
float_list = comma_list(positive_float, "positive numbers")


def choice_list(choices: Sequence[str], what: str = "value") -> Callable[[str], tuple]:
    """argparse type: a non-empty comma-separated subset of ``choices``."""

    def parse_one(part: str) -> str:
        if part not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {part!r}; choose from {', '.join(choices)}")
        return part

    return comma_list(parse_one, f"{what}s among {', '.join(choices)}")


def _add_mode_option(parser, flag, what, meanings, choices, default, many, note) -> None:
    """``flag`` taking one of ``choices`` (a comma list of them with ``many``), its help made from
    ``meanings``: one vocabulary and one wording for every command."""
    listed = f"comma list of {', '.join(meanings[c] for c in choices)}" if many else choices_help(meanings, choices)
    shown = note or f"default: {','.join(default) if many and default else default}"
    parser.add_argument(
        flag,
        type=choice_list(choices, what) if many else None,
        choices=None if many else choices,
        default=default,
        help=f"{listed} ({shown})",
    )


def add_precision_option(
    parser: argparse.ArgumentParser, choices=PRECISIONS, default=None, *, many: bool = False, note: str = ""
) -> None:
    """--precision: one (or with ``many``, a comma list) of ``choices``, fastlm.model.config.PRECISIONS
    or a subset. ``note`` replaces the help's "(default ...)" where the default depends on the device."""
    _add_mode_option(parser, "--precision", "precision", PRECISION_MEANINGS, choices, default, many, note)


def add_compile_option(
    parser: argparse.ArgumentParser, choices=COMPILE_MODES, default=None, *, many: bool = False, note: str = ""
) -> None:
    """--compile: as `add_precision_option`, over fastlm.model.config.COMPILE_MODES."""
    _add_mode_option(parser, "--compile", "compile mode", COMPILE_MEANINGS, choices, default, many, note)


def text_file(text: str) -> Path:
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


def folder(text: str) -> Path:
    """A folder to write into: an existing folder, or one that can be created."""
    try:
        check_writable_folder(Path(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return Path(text)


# ---------------------------------------------------------------------------------------------
# Groups and commands
# ---------------------------------------------------------------------------------------------


def _sentence(summary: str) -> str:
    return f"{summary[0].upper()}{summary[1:]}."


def add_group(groups: argparse._SubParsersAction, name: str, summary: str) -> argparse._SubParsersAction:
    """`fastlm <name>`, listed with ``summary`` among ``groups``; returns the subparsers its commands join."""
    group = groups.add_parser(name, help=summary, description=_sentence(summary))
    return group.add_subparsers(dest="command", required=True)


def add_command(
    commands: argparse._SubParsersAction,
    name: str,
    summary: str,
    handler: Callable[[argparse.Namespace], None],
    duration: tuple[str, str] | None = None,
) -> argparse.ArgumentParser:
    """A command that runs ``handler(args)``, listed with ``summary`` among ``commands``.

    ``duration`` is (on a 2-core CPU, on a GPU), for commands that take more than a few seconds:
    the wall time with the defaults, which their --help states. CPU times are measured on an
    otherwise idle 2-core CPU (torch's CPU build; processes that share the cores take longer); GPU
    times come from the run books in benchmarks/, whose calls run 10 minutes at most.
    """
    description = _sentence(summary)
    if duration:
        cpu, gpu = duration
        description += f" Expected duration with the defaults: on an idle 2-core CPU {cpu}; on a GPU {gpu}."
    parser = commands.add_parser(name, help=summary, description=description)
    parser.set_defaults(func=handler, command_parser=parser)  # command_parser: it reports unknown options
    return parser


def add_out(parser: argparse.ArgumentParser, help: str = "folder for results/ and reports/") -> None:
    parser.add_argument("--out", type=folder, default=Path("fastlm-report"), help=help)
