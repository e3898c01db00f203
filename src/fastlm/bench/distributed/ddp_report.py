"""The report of `fastlm bench ddp`: per number of ranks, from the latest run that measured it, the
step time and communication of each variant with their plots, and the memory of each optimizer."""

from __future__ import annotations

from pathlib import Path

from fastlm.utils.plots import grouped_bar_plot, save_figure
from fastlm.utils.records import latest_runs_by, read_records
from fastlm.utils.tables import markdown_table, present_columns

ALLOCATOR_FIELDS = ("init_mb", "before_step_mb", "after_step_mb", "peak_mb", "activations_mb")  # CUDA allocator only
TIMELINES_FILE = "ddp_timelines.jsonl"  # in the trace folder: the GPU timelines the overlap plots draw
MB = 1e6


STEP_COLUMNS = [
    ("world", "ranks"),
    ("variant", "variant"),
    ("median_ms", "step ms (median)"),
    ("vs_torch_ddp", "vs torch-ddp"),
    ("tokens_per_s", "tokens/s"),
    ("comm_ms", "comm ms"),
    ("comm_kernel_ms", "NCCL kernel ms"),
    ("rounds_ms", "per-round medians ms"),
    ("spread_percent", "round spread %"),
    ("profiled_step_ms", "profiled step ms"),
    ("hidden_percent", "comm hidden behind bwd %"),
    ("exposed_comm_ms", "exposed comm ms"),
    ("status", "status"),
]
MEMORY_COLUMNS = [
    ("world", "ranks"),
    ("optimizer", "optimizer"),
    ("init_mb", "after init MB"),
    ("before_step_mb", "before step MB"),
    ("after_step_mb", "after step MB"),
    ("peak_mb", "peak MB"),
    ("params_mb", "params MB"),
    ("grads_mb", "grads MB"),
    ("optimizer_state_mb", "opt. state MB"),
    ("state_vs_adamw", "state vs adamw"),
    ("activations_mb", "activations MB"),
    ("median_ms", "step ms"),
    ("status", "status"),
]
GLOO_NOTE = (
    "gloo on CPU: no NCCL kernels and no GPU timeline, so communication time and its overlap with the "
    "backward are not measured, nor the memory the CUDA allocator reports ("
    + ", ".join(header for field, header in MEMORY_COLUMNS if field in ALLOCATOR_FIELDS)
    + "); the memory table's "
    + ", ".join(header for field, header in MEMORY_COLUMNS if field.endswith("_mb") and field not in ALLOCATOR_FIELDS)
    + " are the sizes of the tensors, counted. The step times are of CPU processes sharing this machine's "
    "cores and say nothing about GPUs."
)


def round_range(record: dict) -> tuple[float, float] | None:
    """The lowest and highest per-round median step (ms); None with fewer than two rounds."""
    rounds = record.get("round_median_ms") or []
    return (min(rounds), max(rounds)) if len(rounds) >= 2 else None


def compare_steps(record: dict, reference: dict) -> float | str:
    """``record``'s median step over ``reference``'s, or "within noise" where the two variants'
    per-round medians overlap: a difference smaller than the round-to-round spread is no comparison."""
    mine, theirs = round_range(record), round_range(reference)
    if record is not reference and mine and theirs and mine[0] <= theirs[1] and theirs[0] <= mine[1]:
        return "within noise"
    return record["median_ms"] / reference["median_ms"]


def _step_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in (r for r in records if r["kind"] == "step"):
        reference = next(
            (
                t
                for t in records
                if t["kind"] == "step"
                and t["variant"] == "torch-ddp"
                and t["world"] == r["world"]
                and t.get("median_ms")
            ),
            None,
        )
        row = dict(r)
        if reference and r.get("median_ms"):
            row["vs_torch_ddp"] = compare_steps(r, reference)
        spread = round_range(r)
        if spread and r.get("median_ms"):
            row["spread_percent"] = 100 * (spread[1] - spread[0]) / r["median_ms"]
        if r.get("hidden_behind_backward") is not None:
            row["hidden_percent"] = 100 * r["hidden_behind_backward"]
        row["rounds_ms"] = " / ".join(f"{ms:.0f}" for ms in r.get("round_median_ms", []))
        rows.append(row)
    return rows


def _memory_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in (r for r in records if r["kind"] == "memory"):
        row = {
            **r,
            **{
                key.replace("_bytes", "_mb"): value / MB
                for key, value in r.items()
                if key.endswith("_bytes") and value is not None
            },
        }
        unsharded = next(
            (
                t
                for t in records
                if t["kind"] == "memory"
                and t["optimizer"] == "adamw"
                and t["world"] == r["world"]
                and t.get("optimizer_state_bytes")
            ),
            None,
        )
        if unsharded and r.get("optimizer_state_bytes") is not None:
            row["state_vs_adamw"] = r["optimizer_state_bytes"] / unsharded["optimizer_state_bytes"]
        rows.append(row)
    return rows


def overlap_plot(path: Path, records: list[dict], title: str) -> Path:
    """One lane pair per variant: compute kernels coloured by phase above, NCCL kernels below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in records if r.get("timeline")]
    colours = {
        "forward": "tab:blue",
        "backward": "tab:green",
        "sync": "tab:red",
        "optimizer": "tab:purple",
        "other": "tab:gray",
        "comm": "tab:orange",
    }
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(timed) + 1.5))
    for i, record in enumerate(reversed(timed)):
        y = 2 * i
        for lane, intervals in record["timeline"].items():
            offset = 0.0 if lane == "comm" else 0.9
            bars = [(a, b - a) for a, b in intervals]
            ax.broken_barh(bars, (y + offset, 0.8), color=colours.get(lane, "tab:gray"), linewidth=0)
    ax.set_yticks([2 * i + 0.9 for i in range(len(timed))], [r["variant"] for r in reversed(timed)])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(
        handles,
        [name if name != "comm" else "NCCL (lower lane)" for name in colours],
        fontsize=7,
        ncols=6,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
    )
    ax.set_xlabel("ms since the first kernel of the profiled steps")
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def render(results_dir: Path, reports_dir: Path) -> str:
    """One section per number of ranks, from the latest run that measured it (a later 8-rank run
    does not hide the 2- and 4-rank rows of an earlier one); each section's tables come from one run.
    The overlap plots need the GPU timelines in ``<out>/traces`` (beside results/); without them a
    plot already in ``reports_dir`` is shown as it is."""
    runs = latest_runs_by(read_records(results_dir / "ddp.jsonl"), "world")
    if not runs:
        return "No data-parallel records yet: run `fastlm bench ddp`.\n"
    timelines = {
        (t["run_id"], t["world"], t["variant"]): t["timeline"]
        for t in read_records(results_dir.parent / "traces" / TIMELINES_FILE)
    }
    for records in runs:
        for record in records:
            key = (record.get("run_id"), record.get("world"), record.get("variant"))
            if key in timelines:
                record["timeline"] = timelines[key]
    return "\n".join(line for records in runs for line in _render_run(records, reports_dir))


def _render_run(records: list[dict], reports_dir: Path) -> list[str]:
    first = records[0]
    worlds = sorted({r["world"] for r in records})
    tag = "-".join(map(str, worlds))
    lines = [
        f"## {', '.join(map(str, worlds))} ranks",
        "",
        f"Device: {first['gpu']} · {first['backend']} · torch {first['torch']} · git {first['git_sha']} · "
        f"{first['date']} · preset {first['preset']}, context {first['context']}, batch {first['batch']} per rank, "
        f"{first['precision']}, AdamW · median of {first['rounds']} rounds x {first['steps']} steps "
        "(slowest rank each), each round with fresh models · round spread: (highest - lowest per-round "
        "median) / median · vs torch-ddp: the ratio of median steps, or 'within noise' where the two "
        "variants' per-round medians overlap",
        "",
    ]
    if first["backend"] == "gloo":
        lines += [GLOO_NOTE, ""]
    steps = _step_rows(records)
    if steps:
        lines += [
            "### Step time and communication",
            "",
            markdown_table(steps, present_columns(steps, STEP_COLUMNS)),
            "",
        ]
        variants = list(dict.fromkeys(r["variant"] for r in steps))
        series = {
            f"{w} ranks": [
                next((r.get("median_ms") for r in steps if r["world"] == w and r["variant"] == v), None)
                for v in variants
            ]
            for w in worlds
        }
        bars = grouped_bar_plot(
            reports_dir / f"ddp_step_ms_x{tag}.png",
            variants,
            series,
            ylabel="step ms (median)",
            title=f"Data-parallel training step · {first['preset']} · {first['gpu']}",
        )
        lines += [f"![step time per variant, {tag} ranks]({bars.name})", ""]
        for world in worlds:
            timed = [r for r in steps if r["world"] == world and r.get("timeline")]
            plot = reports_dir / f"ddp_overlap_x{world}.png"
            if timed:
                plot = overlap_plot(
                    plot,
                    timed,
                    f"GPU timeline of {first['profile_steps']} steps, rank 0 of {world}: "
                    "compute by phase (upper lane) and NCCL (lower lane)",
                )
            if plot.exists() and first["backend"] == "nccl":  # gloo runs have no GPU timeline
                lines += [f"![communication overlap, {world} ranks]({plot.name})", ""]
    memory = _memory_rows(records)
    if memory:
        lines += [
            "### Memory per rank: optimizer-state sharding",
            "",
            markdown_table(memory, present_columns(memory, MEMORY_COLUMNS)),
            "",
        ]
    return lines
