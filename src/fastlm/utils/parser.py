"""The argument parser of every fastlm command (`fastlm ...`, `python -m fastlm.train`, `python -m
fastlm.data`): --help shows each option's default, a mistake prints one line (under torchrun once
per process, so no usage text repeated per GPU), and options must be spelled out (`--gpu` is not
taken for `--gpus`)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from fastlm.utils.errors import report_error


class DefaultsHelpFormatter(argparse.HelpFormatter):
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


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with the formatter above, no abbreviated options, and one-line errors;
    subcommands inherit it, since add_subparsers makes its parsers of the parent's class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        report_error(f"{self.prog}: error: {message} (see {self.prog} --help)")
        self.exit(2)
