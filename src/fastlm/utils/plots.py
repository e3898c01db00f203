"""PNG plots of records (matplotlib, no display needed): grouped bars, lines, and writing a figure."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def bar_series(
    records: Sequence[dict],
    groups: Sequence[str],
    group_of: Callable[[dict], str],
    implementations: Sequence[str],
    key: str,
) -> dict[str, list[float | None]]:
    """`grouped_bar_plot`'s series: for each of ``implementations`` with an "ok" record, ``key`` of its
    ok record in each of ``groups`` (the group of a record is ``group_of(record)``), None where none."""
    ok = {(group_of(r), r["implementation"]): r for r in records if r["status"] == "ok"}
    return {
        name: [ok.get((group, name), {}).get(key) for group in groups]
        for name in implementations
        if any((group, name) in ok for group in groups)
    }


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
    ``reference_lines`` = (value, label): a dashed horizontal line across the plot. A series with no
    value at all is left out, of the bars and of the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: values for name, values in series.items() if any(v is not None for v in values)}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(groups) + 2), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        ax.bar_label(bars, labels=["" if v is None else f"{v:.2g}" for v in values], fontsize=7, padding=1)
        if markers is not None:
            points = [(x, v) for x, v in zip(xs, markers[0].get(name, ()), strict=False) if v is not None]
            ax.scatter(
                [x for x, _ in points],
                [v for _, v in points],
                marker="_",
                s=width * 400,
                color="black",
                linewidths=2,
                zorder=3,
                label=markers[1] if i == 0 else None,
            )
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


def time_and_memory_plots(
    reports_dir: Path, prefix: str, groups: Sequence[str], series: Callable[[str], dict], title: str
) -> list[str]:
    """The markdown images of a fwd+bwd benchmark: bars of its "fwd_bwd_ms" and, where measured
    (CUDA only), of its "peak_excluding_grads_gib", from ``series(key)`` ({name: values per group});
    written as <prefix>_fwd_bwd_ms.png and <prefix>_peak_memory.png."""
    time_png = grouped_bar_plot(
        reports_dir / f"{prefix}_fwd_bwd_ms.png",
        groups,
        series("fwd_bwd_ms"),
        ylabel="fwd+bwd median ms (lower is better)",
        title=title,
    )
    images = [f"![fwd+bwd time]({time_png.name})"]
    memory = series("peak_excluding_grads_gib")
    if any(v is not None for values in memory.values() for v in values):
        memory_png = grouped_bar_plot(
            reports_dir / f"{prefix}_peak_memory.png",
            groups,
            memory,
            ylabel="peak GiB above the inputs, without the gradients",
            title=title,
        )
        images.append(f"![peak memory]({memory_png.name})")
    return images
