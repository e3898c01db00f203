"""Layout shared by the cost models' terminal tables (`fastlm analyze ...`): they fit 80 columns."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table


def add_columns(table: Table, labels: Sequence[str], numbers: Sequence[str]) -> None:
    """Text columns that wrap (long words folded, never cut to '…') and right-aligned number
    columns kept whole, so a table fits 80 columns without losing a digit."""
    for header in labels:
        table.add_column(header, overflow="fold")
    for header in numbers:
        table.add_column(header, justify="right", no_wrap=True)


def gib(n_bytes: float) -> str:
    """Bytes as GiB (2**30) with two decimals and thousands separators."""
    return f"{n_bytes / 2**30:,.2f} GiB"
