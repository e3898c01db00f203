"""Numbers as text: value formatting, SI prefixes, markdown tables."""

from __future__ import annotations

import math
from collections.abc import Sequence


def format_value(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


LARGE_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
SMALL_PREFIXES = ((1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))


def si(value: float, unit: str = "") -> str:
    """Three significant digits with an SI prefix, for narrow tables: 3.52e13 -> '35.2 T',
    1.05e9 bytes -> '1.05 GB'; values below 1000 stay as they are ('0.25')."""
    rounded = abs(float(f"{value:.3g}"))  # 999.96 rounds to 1000: '1 k', not '1e+03'
    scale, prefix = next(((s, p) for s, p in LARGE_PREFIXES if rounded >= s), (1.0, ""))
    return f"{value / scale:.3g} {prefix}{unit}".rstrip()


def si_seconds(seconds: float) -> str:
    """A duration with three significant digits in s, ms, µs or ns: 0.000137 -> '137 µs'."""
    rounded = abs(float(f"{seconds:.3g}"))
    scale, prefix = next(((s, p) for s, p in SMALL_PREFIXES if rounded >= s), SMALL_PREFIXES[-1])
    return f"{seconds / scale:.3g} {prefix}s"


def _has_value(value) -> bool:
    return format_value(value) not in ("—", "")


def present_columns(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``columns`` that hold a value in some row: a quantity this run did not measure (a GPU
    timing on a CPU run, say) leaves no column of dashes."""
    return [(key, header) for key, header in columns if any(_has_value(row.get(key)) for row in rows)]


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """``columns`` are (key, header) pairs; missing values print as an em dash."""
    lines = ["| " + " | ".join(header for _, header in columns) + " |"]
    lines.append("|" + "|".join(" --- " for _ in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def device_line(record: dict) -> str:
    """Where and with what ``record`` was measured, as a report's first line starts."""
    return (
        f"Device: {record['gpu']} · torch {record['torch']} · triton {record['triton']} · "
        f"git {record['git_sha']} · {record['date']}"
    )
