"""The report of `fastlm bench attention`: per sweep, the latest run's table, fastlm's TFLOP/s ratios to
SDPA's backends, and TFLOP/s-vs-length plots."""

from __future__ import annotations

from pathlib import Path

from fastlm.harness.timing import noted_status
from fastlm.utils.plots import line_plot
from fastlm.utils.tables import device_line, markdown_table, present_columns

CPU_NOTE = (
    "No GPU: fastlm.flash_attention runs its tiled PyTorch path (the Triton interpreter under "
    "TRITON_INTERPRET=1), not the Triton kernels, at reduced shapes; SDPA's flash and cuDNN backends, "
    "peak memory and fastlm's ratios to them need a GPU and are not measured."
)


def latest_sweep(records: list[dict], sweep: str) -> list[dict]:
    """Records of the last run that measured ``sweep``."""
    mine = [r for r in records if r.get("sweep") == sweep]
    if not mine:
        return []
    run_id = mine[-1]["run_id"]
    return [r for r in mine if r["run_id"] == run_id]


BENCH_COLUMNS = [
    ("dtype", "dtype"),
    ("head_dim", "D"),
    ("seq", "N"),
    ("batch", "B"),
    ("implementation", "implementation"),
    ("fwd_ms", "fwd ms"),
    ("bwd_ms", "bwd ms"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("fwd_tflops", "fwd TFLOP/s"),
    ("fwd_bwd_tflops", "fwd+bwd TFLOP/s"),
    ("fwd_bwd_graph_tflops", "fwd+bwd TFLOP/s, CUDA graph"),
    ("peak_memory_mb", "peak MiB"),
    ("status", "status"),
]


def _side_by_side(naive: list[dict], compiled: list[dict]) -> list[dict]:
    """One row per (D, N) with the naive and compiled timings next to each other."""
    rows = {}
    for prefix, records in (("naive", naive), ("compile", compiled)):
        for r in records:
            row = rows.setdefault((r["head_dim"], r["seq"]), {"head_dim": r["head_dim"], "seq": r["seq"]})
            ok = r["status"] == "ok"
            row[f"{prefix}_fwd_ms"] = r.get("fwd_ms") if ok else r["status"]
            row[f"{prefix}_bwd_ms"] = r.get("bwd_ms") if ok else r["status"]
            row[f"{prefix}_memory_mb"] = r.get("memory_before_backward_mb") if ok else r["status"]
    return [rows[key] for key in sorted(rows)]


SIDE_BY_SIDE_COLUMNS = [
    ("head_dim", "D"),
    ("seq", "N"),
    ("naive_fwd_ms", "naive fwd ms"),
    ("compile_fwd_ms", "compile fwd ms"),
    ("naive_bwd_ms", "naive bwd ms"),
    ("compile_bwd_ms", "compile bwd ms"),
    ("naive_memory_mb", "naive MiB before bwd"),
    ("compile_memory_mb", "compile MiB before bwd"),
]


def model_ratios(records: list[dict]) -> list[dict]:
    """fastlm's TFLOP/s over each SDPA backend's, per model shape: through autograd, and as a CUDA
    graph where measured."""
    by_key = {(*_shape(r), r["implementation"]): r for r in records if r["status"] == "ok"}
    rows = []
    for (batch, heads, seq, dim, name), r in sorted(by_key.items(), key=lambda item: item[0][::-1]):
        if name != "fastlm":
            continue
        row = {"batch": batch, "heads": heads, "head_dim": dim, "seq": seq}
        for base in ("sdpa-flash", "sdpa-cudnn"):
            other = by_key.get((batch, heads, seq, dim, base))
            for stage in ("fwd", "fwd_bwd", "fwd_bwd_graph"):
                if other is not None and f"{stage}_tflops" in r and f"{stage}_tflops" in other:
                    row[f"{stage}_vs_{base}"] = r[f"{stage}_tflops"] / other[f"{stage}_tflops"]
        rows.append(row)
    return rows


def _shape(record: dict) -> tuple[int, int, int, int]:
    return record["batch"], record["heads"], record["seq"], record["head_dim"]


VARLEN_COLUMNS = [*BENCH_COLUMNS[:2], ("documents", "documents"), ("longest", "longest"), *BENCH_COLUMNS[4:]]
WINDOW_COLUMNS = [*BENCH_COLUMNS[:3], ("window", "window"), *BENCH_COLUMNS[3:]]
RATIO_COLUMNS = [
    ("batch", "B"),
    ("heads", "H"),
    ("head_dim", "D"),
    ("seq", "N"),
    ("fwd_vs_sdpa-flash", "fwd vs SDPA-flash"),
    ("fwd_bwd_vs_sdpa-flash", "fwd+bwd vs SDPA-flash"),
    ("fwd_bwd_graph_vs_sdpa-flash", "fwd+bwd graph vs SDPA-flash"),
    ("fwd_vs_sdpa-cudnn", "fwd vs SDPA-cuDNN"),
    ("fwd_bwd_vs_sdpa-cudnn", "fwd+bwd vs SDPA-cuDNN"),
    ("fwd_bwd_graph_vs_sdpa-cudnn", "fwd+bwd graph vs SDPA-cuDNN"),
]


def _tflops_plot(records: list[dict], reports_dir: Path, name: str, title: str) -> Path | None:
    """TFLOP/s against sequence length: one panel per (head dim, stage), one line per implementation."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return None
    dims = sorted({r["head_dim"] for r in ok})
    panels = []
    for dim in dims:
        for stage, label in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
            lines = {}
            for r in sorted(ok, key=lambda r: r["seq"]):
                if r["head_dim"] == dim:
                    lines.setdefault(r["implementation"], []).append((r["seq"], r[f"{stage}_tflops"]))
            panels.append((f"D={dim}, {label}", lines))
    return line_plot(reports_dir / name, panels, xlabel="sequence length", ylabel="TFLOP/s", title=title, logx=True)


def _noted(records: list[dict]) -> list[dict]:
    """The records with `noted_status`: a fwd+bwd timed below its forward says why."""
    return [{**r, "status": noted_status(r)} for r in records]


def render(records: list[dict], reports_dir: Path) -> str:
    """Markdown for the latest run of each sweep in ``records``; writes the PNG plots."""
    sections = []
    model = latest_sweep(records, "model")
    if model:
        first = model[0]
        tokens = first["batch"] * first["seq"]  # the plot's shapes; the short ones are in the tables
        plot = _tflops_plot(
            [r for r in model if r["batch"] * r["seq"] == tokens],
            reports_dir,
            "attention_model_tflops.png",
            f"Causal attention, 32k tokens/batch, 16 heads, bf16 ({first['gpu']})",
        )
        ratios = model_ratios(model)
        sections += [
            "## Model shapes (`--sweep model`)",
            device_line(first) + " · tokens per batch fixed, so B = tokens / N · causal, bf16",
            *([CPU_NOTE] if first["gpu"] == "cpu" else []),
            markdown_table(_noted(model), present_columns(model, BENCH_COLUMNS)),
        ]
        measured_ratios = present_columns(ratios, RATIO_COLUMNS[4:])  # after B, H, D and N, which every row has
        if measured_ratios:
            sections += [
                "fastlm's TFLOP/s relative to each SDPA backend:",
                markdown_table(ratios, [*RATIO_COLUMNS[:4], *measured_ratios]),
            ]
        else:
            sections.append("No SDPA backend was measured in this run, so there are no fastlm-vs-SDPA ratios.")
        if plot is not None:
            sections.append(f"![TFLOP/s vs sequence length]({plot.name})")
    flash = latest_sweep(records, "flash")
    if flash:
        plot = _tflops_plot(
            [r for r in flash if r["dtype"] == "bfloat16"],
            reports_dir,
            "attention_flash_tflops.png",
            f"Causal attention, batch 1, one head, bf16 ({flash[0]['gpu']})",
        )
        sections += [
            "## Lengths and head dims (`--sweep flash`)",
            device_line(flash[0]),
            markdown_table(_noted(flash), present_columns(flash, BENCH_COLUMNS)),
        ]
        if plot is not None:
            sections.append(f"![TFLOP/s vs sequence length]({plot.name})")
    varlen = latest_sweep(records, "varlen")
    if varlen:
        first = varlen[0]
        sections += [
            "## Packed documents (`--sweep varlen`)",
            device_line(first) + f" · {first['batch']} x {first['seq']}-token rows, {first['heads']} "
            "heads, causal within each document, bf16 · TFLOP/s of the real (per-document) work",
            markdown_table(_noted(varlen), present_columns(varlen, VARLEN_COLUMNS)),
        ]
    window = latest_sweep(records, "window")
    if window:
        sections += [
            "## Sliding window (`--sweep window`)",
            device_line(window[0]) + " · causal, bf16 · TFLOP/s of the work each mask shows",
            markdown_table(_noted(window), present_columns(window, WINDOW_COLUMNS)),
        ]
    naive, compiled = latest_sweep(records, "naive"), latest_sweep(records, "compile")
    if naive or compiled:
        first = (naive or compiled)[0]
        sections += [
            "## Naive PyTorch attention, eager and compiled (`--sweep naive`, `--sweep compile`)",
            device_line(first) + " · batch 8, one head, fp32, causal mask",
            markdown_table(_side_by_side(naive, compiled), SIDE_BY_SIDE_COLUMNS),
        ]
    if not sections:
        return "No attention records yet: run `fastlm bench attention`.\n"
    return "\n\n".join(sections)
