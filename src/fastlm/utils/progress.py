"""The progress of a long run: a bar on a terminal, plain flushed lines when the output is piped or
logged (where a bar would show only once, at the end).

`progress_steps` prints a line per step when piped (benchmark cases), and a line every 20 s of a
step that runs longer. `progress` prints only the lines it is given (a training log's interval
lines), with the bar's ETA on a terminal:

    with progress("training", total=steps) as bar:
        bar.advance()                 # moves the bar (nothing when piped): call it as often as needed
        bar.note("step 10/100 ...")   # a line, printed above the bar or, piped, on its own
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator


def print_line(text: str) -> None:
    """One line, flushed, so it shows at once also when the output is piped: a note, or progress.
    Module-level, so the distributed benchmarks' worker processes can unpickle it and report from
    rank 0 (a bar redrawn by this process would garble their lines, so those print lines only)."""
    print(text, flush=True)


HEARTBEAT_S = 20.0  # piped: at most this long without a line while a step runs (a log never looks stalled)


@contextlib.contextmanager
def progress_steps(
    name: str, total: int, unit: str = "measurements", heartbeat_s: float = HEARTBEAT_S
) -> Iterator[Callable[..., None]]:
    """Yields ``step(done="")``, called after each of ``total`` steps (``unit`` names them: a
    benchmark's measurements, a profile's phases): a progress bar on a terminal (its elapsed time
    keeps moving during a step); when the output is not a terminal, a line at once ("name: 8
    measurements"), one per step ("name 3/8: done") and, while a step runs longer than
    ``heartbeat_s``, a line every ``heartbeat_s`` saying so ("name 3/8: the 4th running for 40 s")."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(name, total=total)
            yield lambda done="": progress.update(task, description=f"{name} ({done})" if done else name, advance=1)
        return
    print_line(f"{name}: {total} {unit}")
    count = 0
    with heartbeat(
        lambda running_s: f"{name} {count}/{total}: the {ordinal(count + 1)} running for {running_s:.0f} s", heartbeat_s
    ) as beat:

        def step(done: str = "") -> None:
            nonlocal count
            count += 1
            print_line(f"{name} {count}/{total}" + (f": {done}" if done else ""))
            beat()

        yield step


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@contextlib.contextmanager
def heartbeat(line: Callable[[float], str], interval_s: float = HEARTBEAT_S) -> Iterator[Callable[[], None]]:
    """While the block runs, prints ``line(seconds since the last beat)`` each ``interval_s`` without
    a beat, from a thread (the block's own thread is busy measuring); yields ``beat()``, which says
    that the block has just printed. For work whose own lines can be minutes apart."""
    beaten = threading.Event()  # set by each beat and on exit, waking the thread
    state = {"last": time.perf_counter(), "done": False}

    def beat() -> None:
        state["last"] = time.perf_counter()
        beaten.set()

    def run() -> None:
        while True:
            woken = beaten.wait(interval_s)
            if state["done"]:
                return
            if woken:
                beaten.clear()
                continue
            print_line(line(time.perf_counter() - state["last"]))

    thread = threading.Thread(target=run, name="progress heartbeat", daemon=True)
    thread.start()
    try:
        yield beat
    finally:
        state["done"] = True
        beaten.set()
        thread.join()


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
