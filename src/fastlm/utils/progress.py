"""The progress of a long run: a bar on a terminal, plain flushed lines when the output is piped or
logged (where a bar would show only once, at the end).

`progress_steps` prints a line per step when piped (benchmark cases). `progress` prints only the
lines it is given (a training log's interval lines), with the bar's ETA on a terminal:

    with progress("training", total=steps) as bar:
        bar.advance()                 # moves the bar (nothing when piped): call it as often as needed
        bar.note("step 10/100 ...")   # a line, printed above the bar or, piped, on its own
"""

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


class Progress:
    def __init__(self, bar=None, task=None) -> None:
        self._bar, self._task = bar, task

    def advance(self, amount: float = 1) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=amount)

    def note(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, flush=True)


@contextlib.contextmanager
def progress(description: str, total: float, completed: float = 0) -> Iterator[Progress]:
    """A `Progress` over ``total`` units, ``completed`` of them done already (a resumed run)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        yield Progress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Bar(*columns, console=console) as bar:
        yield Progress(bar, bar.add_task(description, total=total, completed=completed))
