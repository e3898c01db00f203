"""The progress of a long run: a bar on a terminal, one plain flushed line per step when the output
is piped or logged (where a bar would show only once, at the end)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


def print_line(text: str) -> None:
    """One line, flushed, so it shows at once also when the output is piped: a note, or progress.
    Module-level, so the distributed benchmarks' worker processes can unpickle it and report from
    rank 0 (a bar redrawn by this process would garble their lines, so those print lines only)."""
    print(text, flush=True)


@contextlib.contextmanager
def progress_steps(name: str, total: int) -> Iterator[Callable[..., None]]:
    """Yields ``step(done="")``, called after each of ``total`` steps: a progress bar on a terminal;
    one plain line per step ("name 3/8: done") when the output is not a terminal."""
    from rich.console import Console

    console = Console()
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
