"""What the commands print: tables and markdown reports (their --help: `fastlm.utils.parser`).

Everything goes through `console` (stdout) and `error_console` (stderr); tests that check a
table's layout swap `console` for one of a fixed width. Progress lines and notes come from
`fastlm.utils.progress`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rich.console import Console, RenderableType


class _Console(Console):
    """A closed stdout (`fastlm ... | head`) ends the command as any other write to it does: `fastlm`'s
    main stops quietly, where rich's own handling would exit with status 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


console = _Console()
error_console = Console(stderr=True)


def print_each(parts: Iterable[RenderableType]) -> None:
    """Tables and sentences (a string is rich markup), in order."""
    for part in parts:
        console.print(part)


def show_report(report: Path) -> None:
    """Print a written report and where it is."""
    console.print(report.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(f"[bold]wrote[/] {report}")
