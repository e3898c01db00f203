"""What the commands print: tables, markdown reports, and --help with defaults.

Everything goes through `console` (stdout) and `error_console` (stderr); tests that check a
table's layout swap `console` for one of a fixed width. Progress lines and notes come from
`fastlm.utils.progress`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console, RenderableType

console = Console()
error_console = Console(stderr=True)


def print_each(parts: Iterable[RenderableType]) -> None:
    """Tables and sentences (a string is rich markup), in order."""
    for part in parts:
        console.print(part)


def show_report(report: Path) -> None:
    """Print a written report and where it is."""
    console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote[/] {report}")


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
    """An ArgumentParser with the formatter above; subcommands inherit it, since add_subparsers
    makes its parsers of the parent's class."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
