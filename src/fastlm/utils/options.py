"""Typed configurations whose fields are also command-line options, so an option is declared once:
its type, default, help and limits sit on the field, and the parser is generated from the fields.

    @dataclass
    class Settings:
        steps: int = option(1000, "optimizer steps", limit="positive")

    add_options(parser, Settings)                  # --steps STEPS  optimizer steps (default: 1000)
    settings = from_namespace(Settings, parser.parse_args())
    check_limits(settings)                         # UserError: "--steps must be at least 1, got 0"

A field's flag is its name with dashes. The parser takes plain values (int, float, str, Path); the
limits are checked after parsing by `check_limits`, so a config built in Python is checked the same
way. Without torch: command lines build their parsers before any command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing

from fastlm.utils.errors import UserError

SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT): what torch's generators and numpy's PCG64 both take
# limit -> (whether an int value meets it, whether a float value does, what is expected of an int, of a float)
LIMITS = {
    "positive": (lambda v: v >= 1, lambda v: math.isfinite(v) and v > 0, "at least 1", "a positive number"),
    "non_negative": (lambda v: v >= 0, lambda v: math.isfinite(v) and v >= 0, "0 or more", "0 or a positive number"),
    "fraction": (None, lambda v: 0 <= v <= 1, None, "between 0 and 1"),
    "seed": (lambda v: 0 <= v < SEED_LIMIT, None, "between 0 and 2**63 - 1", None),
}


def option(default, help: str, *, limit: str | None = None, **argparse_kwargs) -> dataclasses.Field:
    """A config field that is an option: ``default``, ``help`` (the generated help adds the default
    unless ``help`` says what it is), the `LIMITS` its value must meet, and anything argparse needs
    beyond the field's type (choices, metavar, nargs, ...)."""
    metadata = {"help": help, "limit": limit, "argparse": argparse_kwargs}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _value_type(hint) -> type:
    """int for `int | None`, str for `list[str]`, ...: what one command-line value parses to."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, tuple):
        return args[0]
    return args[0] if args else hint


def add_options(parser: argparse.ArgumentParser, config_class: type, exclude=(), overrides: dict | None = None) -> None:
    """An option per field of ``config_class`` but ``exclude``. ``overrides`` maps a field to
    argparse arguments that replace its own (a comma list where a command takes several values)."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name in exclude:
            continue
        kwargs = {**field.metadata["argparse"], "help": field.metadata["help"], **(overrides or {}).get(field.name, {})}
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        default = kwargs.pop("default", default)
        hint = hints[field.name]
        if hint is bool:
            kwargs.setdefault("action", "store_true")
        else:
            if typing.get_origin(hint) is list:
                kwargs.setdefault("action", "append")
            kwargs.setdefault("type", _value_type(hint))
        help_text = kwargs.pop("help")
        if "default" not in help_text and default is not None and default is not False and not kwargs.get("required"):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            help_text = f"{help_text} (default: {f'{shown:g}' if isinstance(shown, float) else shown})"
        parser.add_argument(flag(field.name), default=default, help=help_text.replace("%", "%%"), **kwargs)


def from_namespace(config_class: type, args: argparse.Namespace, **values):
    """The config of the parsed ``args`` (fields not among them keep their defaults), with ``values``."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{**{k: v for k, v in vars(args).items() if k in names}, **values})


def check_limits(config, config_class: type | None = None) -> None:
    """UserError, naming the option, for the first field (of ``config_class``, by default the
    config's own class) whose value is outside its limit."""
    for field in dataclasses.fields(config_class or config):
        limit, value = field.metadata.get("limit"), getattr(config, field.name)
        if limit is None or value is None:
            continue
        holds_int, holds_float, expected_int, expected_float = LIMITS[limit]
        holds, expected = (holds_int, expected_int) if isinstance(value, int) else (holds_float, expected_float)
        if not holds(value):
            raise UserError(f"{flag(field.name)} must be {expected}, got {value}")
