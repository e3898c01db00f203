"""What the commands print: progress, notes, tables, markdown reports, and --help with defaults.

Everything goes through `console` (stdout) and `error_console` (stderr); tests that check a
table's layout swap `console` for one of a fixed width.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console, RenderableType

console = Console()
error_console = Console(stderr=True)


def print_line(text: str) -> None:
    """One line, flushed, so it shows at once also when the output is piped: a note, or progress.
    Module-level, so the distributed benchmarks' worker processes can unpickle it and report from
    rank 0 (a bar redrawn by this process would garble their lines, so those print lines only)."""
    print(text, flush=True)


@contextlib.contextmanager
def progress_steps(name: str, total: int):
    """Yields ``step(done="")`` for a long run: a progress bar on a terminal; one plain line per step,
    flushed, when the output is piped or logged (where a bar would show only once, at the end)."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(name, total=total)
            yield lambda done="": progress.update(task, description=f"{name} ({done})" if done else name, advance=1)
        return
    count = 0

    def step(done: str = "") -> None:
        nonlocal count
        count += 1
        print_line(f"{name} {count}/{total}" + (f": {done}" if done else ""))

    yield step


def note_without_gpu(device, note: str) -> None:
    """Say what a GPU benchmark run on the CPU does not measure, before it starts."""
    if device.type != "cuda":
        print_line(note)


def print_each(parts: Iterable[RenderableType]) -> None:
    """Tables and sentences (a string is rich markup), in order."""
    for part in parts:
        console.print(part)


def write_report(path: Path, title: str, body: str) -> Path:
    """A markdown report: ``# title``, then ``body``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{body}\n")
    return path


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
