"""The report of `fastlm bench model`: per run, a table of step times with their spread over rounds,
tokens/s and MFU, the tokens/s ratios between the models and kernel sets of the run, and a plot of
the training step's MFU."""

from __future__ import annotations

import statistics
from pathlib import Path

from fastlm.utils.plots import grouped_bar_plot
from fastlm.utils.tables import markdown_table, present_columns

CPU_NOTE = (
    "No GPU: steps of the model on the CPU (where a row's switches pick fastlm kernels, they run their "
    "PyTorch paths); MFU and peak memory need a GPU and are not measured, and these step times say nothing "
    "about GPU step times."
)

COLUMNS = [
    ("implementation", "model"),
    ("preset", "preset"),
    ("kernels", "attention / norm / rope / mlp / loss"),
    ("mode", "mode"),
    ("precision", "precision"),
    ("compile", "compile"),
    ("first_step_ms", "first step ms"),
    ("step_ms", "step ms: median (rounds min-max)"),
    ("p20_p80_ms", "step ms p20-p80"),
    ("tokens_per_s", "tokens/s"),
    ("mfu_percent", "MFU %"),
    ("peak_memory_gib", "peak GiB"),
    ("status", "status"),
]

RATIO_COLUMNS = [
    ("preset", "preset"),
    ("mode", "mode"),
    ("precision", "precision"),
    ("compile", "compile"),
    ("model", "model / kernels"),
    ("tokens_per_s", "tokens/s"),
    ("vs_torch_kernels", "tokens/s vs PyTorch kernels"),
    ("vs_hf", "tokens/s vs HF Llama"),
]


def _number(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def with_spread(value: float, low: float, high: float, unit: str = "") -> str:
    """'101.8 (98.9-104.0)': a value and its spread, the spread left out where it is empty."""
    if low == high:
        return f"{_number(value)}{unit}"
    return f"{_number(value)}{unit} ({_number(low)}-{_number(high)})"


def round_medians(record: dict) -> list[float]:
    """The per-round median step times; one round for records written before rounds existed."""
    return record.get("round_median_ms") or [record["median_ms"]]


def _display(record: dict) -> dict:
    row = dict(record)
    # records before a switch existed ran its PyTorch path
    switches = (record["attention"], record["norm"], record.get("rope", "torch"), record.get("mlp", "torch"))
    row["kernels"] = " / ".join((*switches, record["loss"]))
    if record.get("implementation") == "hf-llama":
        row["kernels"] = "transformers (sdpa)"
    if record.get("status") != "ok":
        return row
    median, low, high = record["median_ms"], min(round_medians(record)), max(round_medians(record))
    row["step_ms"] = with_spread(median, low, high)
    if record.get("p20_ms") is not None:
        row["p20_p80_ms"] = f"{_number(record['p20_ms'])}-{_number(record['p80_ms'])}"
    # tokens/s and MFU scale with 1 / step time: the slowest round gives the low end
    row["tokens_per_s"] = with_spread(
        record["tokens_per_s"], record["tokens_per_s"] * median / high, record["tokens_per_s"] * median / low
    )
    if record.get("mfu") is not None:
        mfu_percent = 100 * record["mfu"]
        row["mfu_percent"] = with_spread(mfu_percent, mfu_percent * median / high, mfu_percent * median / low)
    return row


def speed_ratio(record: dict, baseline: dict) -> tuple[float, float, float]:
    """tokens/s of ``record`` over ``baseline``'s: (value, low, high). Interleaved rounds pair up,
    so the value is the median of the per-round ratios and the spread their min and max; rounds run
    back to back do not pair, so the value is the ratio of the medians and the spread the extremes
    (fastest against slowest round)."""
    ours, theirs = round_medians(record), round_medians(baseline)
    paired = record.get("schedule") == baseline.get("schedule") == "interleaved" and len(ours) == len(theirs)
    if paired:
        ratios = [b / a for a, b in zip(ours, theirs, strict=True)]
        return statistics.median(ratios), min(ratios), max(ratios)
    return baseline["median_ms"] / record["median_ms"], min(theirs) / max(ours), max(theirs) / min(ours)


def _is_torch_kernels(record: dict) -> bool:
    return (
        record["implementation"] == "fastlm"
        and record["attention"] == "sdpa"
        and record["norm"] == "torch"
        and record.get("rope", "torch") == "torch"
        and record.get("mlp", "torch") == "torch"
        and record["loss"] == "torch"
    )


def ratio_rows(records: list[dict]) -> list[dict]:
    """For each (preset, mode, precision, compile) measured with more than one model or kernel set:
    every row's tokens/s against our model with PyTorch kernels and against HF Llama."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("status") == "ok":
            key = (r["preset"], r["d_model"], r["num_layers"], r["batch"], r["mode"], r["precision"], r["compile"])
            groups.setdefault(key, []).append(r)
    rows_out = []
    for group in groups.values():
        if len(group) < 2:
            continue
        torch_kernels = next((r for r in group if _is_torch_kernels(r)), None)
        hf = next((r for r in group if r["implementation"] == "hf-llama"), None)
        for r in group:
            display = _display(r)
            row = {k: r[k] for k in ("preset", "mode", "precision", "compile")}
            row["model"] = "HF Llama" if r is hf else f"fastlm, {display['kernels']}"
            row["tokens_per_s"] = display["tokens_per_s"]
            if torch_kernels is not None and r is not torch_kernels and r is not hf:
                row["vs_torch_kernels"] = with_spread(*speed_ratio(r, torch_kernels), unit="x")
            if hf is not None and r is not hf:
                row["vs_hf"] = with_spread(*speed_ratio(r, hf), unit="x")
            rows_out.append(row)
    return rows_out


def _mfu_plot(records: list[dict], reports_dir: Path) -> Path | None:
    """MFU of the training step per preset, one bar per (implementation, kernels, precision, compile)."""
    train = [r for r in records if r["mode"] == "train" and r.get("mfu") is not None]
    if not train:
        return None
    presets = list(dict.fromkeys(r["preset"] for r in records))

    def series_name(r: dict) -> str:
        if r["implementation"] == "hf-llama":
            return f"HF Llama {r['precision']} {r['compile']} batch {r['batch']}"
        kernels = "fastlm kernels" if r["attention"] == "fastlm" else f"{r['attention']} attention"
        return f"{kernels} {r['precision']} {r['compile']} batch {r['batch']}"

    series: dict[str, list[float | None]] = {}
    for r in train:
        values = series.setdefault(series_name(r), [None] * len(presets))
        values[presets.index(r["preset"])] = 100 * r["mfu"]
    return grouped_bar_plot(
        reports_dir / "model_mfu.png",
        presets,
        series,
        ylabel="MFU % (bf16 dense peak)",
        title="Training step MFU by preset (batch x context tokens per step)",
    )


def _runs(records: list[dict], count: int) -> list[list[dict]]:
    """The last ``count`` runs, oldest first, each as its own list of records."""
    by_run: dict[str, list[dict]] = {}
    for record in records:
        by_run.setdefault(record["run_id"], []).append(record)
    return list(by_run.values())[-count:]


def render(records: list[dict], reports_dir: Path, runs: int = 1) -> str:
    """One table per run (the last ``runs`` runs of ``records``: never mixing timings of runs in a
    table) and a plot of the training-step MFU of all of them."""
    selected = _runs(records, runs)
    if not selected:
        return "No model records yet: run `fastlm bench model`.\n"
    lines = []
    for records in selected:
        first = records[0]
        displayed = [_display(r) for r in records]
        rounds = first.get("rounds", 1)
        schedule = f", {rounds} rounds {first['schedule']} ({first['schedule_reason']})" if rounds > 1 else ""
        lines += [
            f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · {first['date']} · "
            f"batch {first['batch']} x context {first['context_length']}, vocab {first['vocab_size']}, "
            f"{first['warmup']} warm-up + {first['steps']} timed steps per row and round{schedule}",
            "",
            *([CPU_NOTE, ""] if first["gpu"] == "cpu" else []),
            markdown_table(displayed, present_columns(displayed, COLUMNS)),
            "",
        ]
        ratios = ratio_rows(records)
        if ratios:
            if rounds == 1:
                spread = "one round, so no spread"
            elif first["schedule"] == "interleaved":
                spread = "in brackets the lowest and highest per-round ratio (rounds interleaved, so paired)"
            else:
                spread = "in brackets the slowest and fastest round against each other (rounds back to back)"
            lines += [
                f"tokens/s ratios within this run, from the medians over rounds; {spread}:",
                "",
                markdown_table(ratios, RATIO_COLUMNS),
                "",
            ]
    plot = _mfu_plot([r for records in selected for r in records], reports_dir)
    if plot is not None:
        lines.append(f"![training-step MFU]({plot.name})")
    return "\n".join(lines)
