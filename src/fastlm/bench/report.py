"""Rendering of records: markdown tables and PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


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


def grouped_bar_plot(
    path: Path,
    groups: Sequence[str],
    series: dict[str, Sequence[float | None]],
    *,
    ylabel: str,
    title: str,
    reference_line: tuple[float, str] | None = None,
    markers: tuple[dict[str, Sequence[float | None]], str] | None = None,
    reference_lines: Sequence[tuple[float, str]] = (),
) -> Path:
    """One group of bars per entry of ``groups`` and one bar colour per series; None is a gap.
    ``markers`` = (values per series, legend label): a second quantity drawn as a black tick on
    each series' bars (e.g. the same work timed another way). ``reference_line`` and each of
    ``reference_lines`` = (value, label): a dashed horizontal line across the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(groups) + 2), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        ax.bar_label(bars, labels=["" if v is None else f"{v:.2g}" for v in values], fontsize=7, padding=1)
        if markers is not None:
            points = [(x, v) for x, v in zip(xs, markers[0].get(name, ()), strict=False) if v is not None]
            ax.scatter([x for x, _ in points], [v for _, v in points], marker="_", s=width * 400, color="black",
                       linewidths=2, zorder=3, label=markers[1] if i == 0 else None)  # fmt: skip
    for value, label in ([reference_line] if reference_line is not None else []) + list(reference_lines):
        ax.axhline(value, color="black", linestyle="--", linewidth=1)
        ax.annotate(label, (len(groups) - 0.5, value), ha="right", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncols=2)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path, dpi=120)


def line_plot(
    path: Path,
    panels: Sequence[tuple[str, dict[str, Sequence[tuple[float, float]]]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> Path:
    """Side-by-side panels, each (panel title, {series name: [(x, y), ...]}), one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(len(panels), 4)
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
    for ax, (panel_title, series) in zip(axes.flat, panels, strict=False):
        for name, points in series.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=name)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    return save_figure(fig, path, dpi=120)
