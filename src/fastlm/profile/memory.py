"""`fastlm profile memory`: memory over one forward pass or training step, per context length.

On a GPU the CUDA caching allocator records its history (`torch.cuda.memory._record_memory_history`)
over one step taken after a warm-up step (so AdamW's state and library workspaces already exist);
the snapshot is dumped as a pickle for pytorch.org/memory_viz and turned into
- the active-memory timeline (bytes allocated after every alloc / free of the step), drawn as PNG
  and as a self-contained HTML page (inline SVG, no network) that also lists the largest
  allocations alive at the peak with the line of code that made each;
- the peak of the step (`torch.cuda.max_memory_allocated`);
- the median step time before and after recording, showing that the tool leaves no cost behind.
Without a GPU, the timeline comes from torch.profiler's memory profile of the CPU tensors instead
(same plots, no allocator snapshot), so the command runs end to end anywhere.
"""

from __future__ import annotations

import dataclasses
import html
import io
import pickle
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.harness.steps import Row, make_optimizer, make_step, time_steps
from fastlm.model import ModelConfig, TransformerLM
from fastlm.utils.plots import save_figure
from fastlm.utils.records import append_records, with_environment
from fastlm.utils.tables import markdown_table

RESULTS_FILE = "profile_memory.jsonl"
LARGEST_AT_PEAK = 12  # allocations listed in the HTML page
COST_STEPS = 5  # steps timed before and after recording, to show the tool leaves no cost behind


@dataclass
class Timeline:
    times_ms: list[float]  # since the start of the recorded step
    active_bytes: list[int]  # bytes allocated after each event
    largest_at_peak: list[tuple[int, str]]  # (bytes, where it was allocated), largest first; GPU only

    @property
    def peak_bytes(self) -> int:
        return max(self.active_bytes)


def _where(frames: list[dict]) -> str:
    """The innermost frames outside torch's own files: the model code that asked for the memory."""
    own = [f for f in frames if "/torch/" not in f["filename"] and not f["filename"].startswith("<")]
    picked = own[:2] or frames[:1]
    return " ← ".join(f"{f['name']} ({Path(f['filename']).name}:{f['line']})" for f in picked) or "?"


def timeline_from_snapshot(snapshot: dict, device_index: int) -> Timeline:
    """Active bytes over the trace of one device. Blocks allocated before recording began are the
    baseline: what is active at the end, minus what the trace added."""
    trace = [e for e in snapshot["device_traces"][device_index] if e["action"] in ("alloc", "free_completed")]
    active_at_end = sum(
        block["size"]
        for segment in snapshot["segments"]
        if segment["device"] == device_index
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in trace)
    active = active_at_end - net
    start_us = trace[0]["time_us"] if trace else 0
    times, values = [0.0], [active]
    live: dict[int, tuple[int, str]] = {}
    peak, at_peak = active, {}
    for event in trace:
        if event["action"] == "alloc":
            active += event["size"]
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
        else:
            active -= event["size"]
            live.pop(event["addr"], None)
        times.append((event["time_us"] - start_us) / 1e3)
        values.append(active)
        if active > peak:
            peak, at_peak = active, dict(live)
    before = peak - sum(size for size, _ in at_peak.values())
    largest = sorted(at_peak.values(), reverse=True)[:LARGEST_AT_PEAK]
    return Timeline(times, values, [(before, "allocated before the step (parameters, optimizer state, ...)"), *largest])


def timeline_from_profiler(profiler: torch.profiler.profile) -> Timeline:
    """Active CPU tensor bytes over a profiled step, from torch.profiler's memory profile."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    times_us, sizes = MemoryProfileTimeline(profiler._memory_profile())._coalesce_timeline("cpu")
    start = next((t for t in times_us if t >= 0), 0)
    return Timeline([max(t - start, 0) / 1e3 for t in times_us], [sum(s) for s in sizes], [])


def record_step(
    step: Callable[[], None], model: torch.nn.Module, device: torch.device, snapshot_path: Path | None
) -> tuple[Timeline, int]:
    """One step recorded after a warm-up step: its timeline and its peak bytes."""
    step()
    if device.type != "cuda":
        # The step drops the warm-up step's gradients first anyway; dropping them before recording
        # keeps the CPU profiler from seeing a free of a block allocated before it started, which
        # it reports as a warning on stderr.
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
        ) as profiler:
            step()
        timeline = timeline_from_profiler(profiler)
        return timeline, timeline.peak_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if snapshot_path is not None:
        snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        with snapshot_path.open("wb") as f:
            pickle.dump(snapshot, f)
    return timeline_from_snapshot(snapshot, torch.cuda.current_device()), torch.cuda.max_memory_allocated()


def run(
    config: ModelConfig,
    preset: str,
    *,
    contexts: tuple[int, ...],
    modes: tuple[str, ...],
    precisions: tuple[str, ...],
    batch: int,
    device: torch.device,
    out: Path,
    progress: Callable[[str], None] = lambda done: None,
) -> tuple[list[dict], dict[tuple[str, str, int], Timeline]]:
    """Peak memory of every (context, mode, precision); snapshots and HTML pages for the longest
    context. The model is built once, for the longest context."""
    model = TransformerLM(dataclasses.replace(config, context_length=max(contexts))).to(device)
    records, timelines = [], {}
    for mode in modes:
        for precision in precisions:
            optimizer = make_optimizer(model) if mode == "train" else None
            for context in sorted(contexts):
                tokens = torch.randint(0, config.vocab_size, (batch, context), device=device)
                targets = torch.randint(0, config.vocab_size, (batch, context), device=device)
                row = Row(mode, precision, "eager")
                step = make_step(model, model, row, tokens, targets, optimizer)
                name = f"memory_{preset}_{mode}_{precision}_ctx{context}"
                keep = context == max(contexts)
                snapshot = out / "snapshots" / f"{name}.pickle" if keep and device.type == "cuda" else None
                before_ms = statistics.median(time_steps(step, 1, COST_STEPS, device))
                timeline, peak = record_step(step, model, device, snapshot)
                after_ms = statistics.median(time_steps(step, 0, COST_STEPS, device))
                model.zero_grad(set_to_none=True)
                timelines[(mode, precision, context)] = timeline
                if keep:
                    write_html(
                        out / "reports" / f"{name}.html",
                        timeline,
                        f"{preset} · {mode} · {precision} · context {context} · batch {batch}",
                    )
                records.append(
                    with_environment(
                        {
                            "op": "profile_memory",
                            "preset": preset,
                            **config.record_fields(),
                            "batch": batch,
                            "context": context,
                            "mode": mode,
                            "precision": precision,
                            "peak_gib": peak / 2**30,
                            "snapshot": None if snapshot is None else snapshot.name,
                            "step_ms": before_ms,
                            "after_recording_overhead_percent": 100 * (after_ms / before_ms - 1),
                        }
                    )
                )
                progress(f"{mode} {precision} context {context}")
            del optimizer
    append_records(out / "results" / RESULTS_FILE, records)
    return records, timelines


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _figure(panels: dict[str, dict[str, Timeline]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(len(panels), 2)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.0 * columns, 3.6 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels.items(), strict=True):
        for label, timeline in lines.items():
            ax.step(timeline.times_ms, [b / 2**30 for b in timeline.active_bytes], where="post", label=label)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("time in step (ms)")
        ax.set_ylabel("active memory (GiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, plt


def timeline_plot(path: Path, timelines: dict[tuple[str, str, int], Timeline], title: str) -> Path:
    """One panel per (mode, precision), one line per context length."""
    panels: dict[str, dict[str, Timeline]] = {}
    for (mode, precision, context), timeline in sorted(timelines.items(), key=lambda kv: kv[0][2]):
        panels.setdefault(f"{mode} · {precision}", {})[f"context {context}"] = timeline
    fig, plt = _figure(panels)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def write_html(path: Path, timeline: Timeline, title: str) -> Path:
    """A page that needs nothing but a browser: the timeline as inline SVG and the largest
    allocations alive at the peak."""
    fig, plt = _figure({title: {"active memory": timeline}})
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    plt.close(fig)
    rows = "".join(
        f"<tr><td style='text-align:right'>{size / 2**20:,.1f}</td><td>{html.escape(where)}</td></tr>"
        for size, where in timeline.largest_at_peak
    )
    table = (
        (
            f"<h2>Alive at the peak ({timeline.peak_bytes / 2**30:.2f} GiB)</h2><table border=1 cellpadding=4>"
            f"<tr><th>MiB</th><th>allocated by</th></tr>{rows}</table>"
        )
        if rows
        else ""
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<h1>{html.escape(title)}</h1>{svg.getvalue()[svg.getvalue().find('<svg') :]}{table}"
    )
    return path


def render(records: list[dict], plot: Path) -> str:
    first = records[0]
    table = [
        {
            "context": r["context"],
            "mode": r["mode"],
            "precision": r["precision"],
            "peak": r["peak_gib"],
            "step": r["step_ms"],
            "after": r["after_recording_overhead_percent"],
        }
        for r in records
    ]
    return "\n".join(
        [
            f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · preset {first['preset']} · "
            f"batch {first['batch']} · peak of one step after a warm-up step",
            "",
            markdown_table(
                table,
                [
                    ("context", "context"),
                    ("mode", "mode"),
                    ("precision", "precision"),
                    ("peak", "peak GiB"),
                    ("step", "step ms"),
                    ("after", "step after recording, % slower"),
                ],
            ),
            "",
            f"![active memory over one step]({plot.name})",
        ]
    )
