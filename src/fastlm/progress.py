"""Progress of long work: a bar on a terminal, plain lines when the output is piped or logged.

    with progress("training", total=steps) as bar:
        bar.advance()                 # moves the bar (nothing when piped): call it as often as needed
        bar.note("step 10/100 ...")   # a line, printed above the bar or, piped, on its own

Lines are flushed as they are written, so a log file or `tee` shows them at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console


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
    console = Console()
    if not console.is_terminal:
        yield Progress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Bar(*columns, console=console) as bar:
        yield Progress(bar, bar.add_task(description, total=total, completed=completed))
