"""`fastlm profile model`: where the time of an inference pass and of a training step goes.

For each phase (inference = forward under no_grad; train = forward, backward, AdamW step) the
model runs `warmup` untraced steps, then `steps` steps under torch.profiler with the named ranges
of `fastlm.layers.ranges` on (forward / backward / optimizer, and inside the naive attention path
attention/scores, mask, softmax, output; they are NVTX ranges too, so `nsys profile fastlm profile
model` shows the same structure in Nsight Systems). Reported per phase: GPU time per named range,
the top kernels of each range (Nsight's "CUDA GPU Kernel Summary": name, calls, total, average,
share), the share of matrix multiplies vs other kernels, and for attention each stage's time next
to its FLOPs. A Chrome trace per phase is written for chrome://tracing or ui.perfetto.dev.

The tool's own cost outside the traced window is measured too: steps with the ranges switched on
(no profiler) and steps after the profiler has stopped, against plain steps.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from fastlm.analysis.attention import naive_attention_stage_flops
from fastlm.harness.steps import make_optimizer, time_steps
from fastlm.layers.ranges import annotate, annotations
from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.precision import precision_context
from fastlm.profile.kernels import OUTSIDE, KernelStats, category_shares, merge, summarize_kernels
from fastlm.utils.records import append_records, with_environment
from fastlm.utils.tables import markdown_table

RESULTS_FILE = "profile_model.jsonl"
PHASES = ("inference", "train")
TOP_RANGES = ("forward", "backward", "optimizer")
ATTENTION_STAGES = ("scores", "mask", "softmax", "output")
RANGES = TOP_RANGES + tuple(f"attention/{stage}" for stage in ATTENTION_STAGES)
TOP_KERNELS = 8
OVERHEAD_ROUNDS = 3  # interleaved rounds of plain and annotated steps when measuring the tool's own cost
PROGRESS_STEPS = 3 * len(PHASES)  # per phase: timed without the profiler, profiled, timed after it


def make_phase_step(model: TransformerLM, phase: str, precision: str, batch: int) -> Callable[[], None]:
    config, device = model.config, next(model.parameters()).device
    tokens = torch.randint(0, config.vocab_size, (batch, config.context_length), device=device)
    targets = torch.randint(0, config.vocab_size, (batch, config.context_length), device=device)
    if phase == "inference":

        def step() -> None:
            with torch.no_grad(), precision_context(precision, device):
                model(tokens)

        return step
    optimizer = make_optimizer(model)

    def step() -> None:
        with precision_context(precision, device):
            loss = model(tokens, targets)
        with annotate("backward"):
            loss.backward()
        with annotate("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


def _median_ms(step: Callable[[], None], steps: int, device: torch.device) -> float:
    return statistics.median(time_steps(step, 0, steps, device))


@dataclasses.dataclass
class PhaseProfile:
    phase: str
    steps: int
    on_gpu: bool
    summary: dict[str, dict[str, KernelStats]]  # range -> kernel name -> stats (all profiled steps)
    trace: Path
    plain_ms: float  # median step, no ranges, no profiler
    annotated_ms: float  # median step with the named ranges on, no profiler
    plain_spread_percent: float  # range of the plain rounds' medians, % of plain_ms
    after_ms: float  # median step after the profiler stopped

    def range_ms_per_step(self, name: str) -> float:
        return sum(s.total_us for s in self.summary.get(name, {}).values()) / 1e3 / self.steps

    def top_level(self) -> dict[str, KernelStats]:
        """Every kernel of the step (the attention/* ranges nest inside forward)."""
        return merge(*self.summary.values())


def overhead_timings(step: Callable[[], None], device: torch.device, steps: int) -> tuple[float, float, float]:
    """Median ms of plain steps and of steps with the named ranges on (no profiler), interleaved so
    that drift in clocks or host load hits both alike, and the plain steps' spread: the range of
    their rounds' medians in % of their median, below which a measured cost is noise."""
    rounds, annotated = [], []
    for _ in range(OVERHEAD_ROUNDS):
        rounds.append(time_steps(step, 0, steps, device))
        with annotations():
            annotated += time_steps(step, 0, steps, device)
    plain = statistics.median(ms for one_round in rounds for ms in one_round)
    medians = [statistics.median(one_round) for one_round in rounds]
    return plain, statistics.median(annotated), 100 * (max(medians) - min(medians)) / plain


def profile_steps(step: Callable[[], None], phase: str, steps: int, device: torch.device, trace_dir: Path):
    """``steps`` steps under torch.profiler with the ranges on; writes the Chrome trace and
    returns (range -> kernel stats, whether they are GPU kernels, trace path)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with annotations(), torch.profiler.profile(activities=activities) as profiler:
        time_steps(step, 0, steps, device)
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir / f"profile_model_{phase}.trace.json"
    profiler.export_chrome_trace(str(trace))
    summary, on_gpu = summarize_kernels(profiler.events(), set(RANGES))
    return summary, on_gpu, trace


def attention_stages(profile: PhaseProfile, config: ModelConfig, batch: int) -> list[dict]:
    """Time per step of each naive-attention stage next to its FLOPs (all layers)."""
    flops = naive_attention_stage_flops(batch, config.num_heads, config.context_length, config.head_dim)
    rows = []
    for stage in ATTENTION_STAGES:
        ms = profile.range_ms_per_step(f"attention/{stage}")
        stage_flops = config.num_layers * flops[stage]
        rows.append(
            {
                "stage": stage,
                "ms_per_step": ms,
                "gflop_per_step": stage_flops / 1e9,
                "tflops": stage_flops / (ms * 1e9) if ms > 0 else None,
            }
        )
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    for r in rows:
        r["share_percent"] = 100 * r["ms_per_step"] / total
    return rows


def _overhead_percent(profile: PhaseProfile, field: str) -> float:
    return 100 * (getattr(profile, field) / profile.plain_ms - 1)


def record(profile: PhaseProfile, config: ModelConfig, preset: str, batch: int, precision: str) -> dict:
    whole = profile.top_level()
    return with_environment(
        {
            "op": "profile_model",
            "preset": preset,
            **config.record_fields(),
            "batch": batch,
            "precision": precision,
            "phase": profile.phase,
            "steps": profile.steps,
            "gpu_kernels": profile.on_gpu,
            "range_ms_per_step": {name: profile.range_ms_per_step(name) for name in (*RANGES, OUTSIDE)},
            "step_kernel_ms": sum(s.total_us for s in whole.values()) / 1e3 / profile.steps,
            "category_shares": category_shares(whole),
            "attention_stages": attention_stages(profile, config, batch)
            if config.kernels.attention == "naive"
            else None,
            "plain_ms": profile.plain_ms,
            "plain_spread_percent": profile.plain_spread_percent,
            "annotated_overhead_percent": _overhead_percent(profile, "annotated_ms"),
            "after_profiler_overhead_percent": _overhead_percent(profile, "after_ms"),
        }
    )


def run(
    config: ModelConfig,
    preset: str,
    *,
    batch: int,
    precision: str,
    warmup: int,
    steps: int,
    device: torch.device,
    out: Path,
    timing_steps: int = 10,
    progress: Callable[[str], None] = lambda done: None,
) -> tuple[list[PhaseProfile], list[dict]]:
    """Profile both phases of one model; ``timing_steps`` x 3 steps per median of the tool's cost.
    ``progress`` is called after each of the PROGRESS_STEPS stages."""
    model = TransformerLM(config).to(device)
    step_of = {phase: make_phase_step(model, phase, precision, batch) for phase in PHASES}
    timings = {}
    for phase, step in step_of.items():  # every baseline before the first profiler starts
        time_steps(step, warmup, 0, device)
        timings[phase] = overhead_timings(step, device, timing_steps)
        progress(f"{phase}: steps timed with and without the ranges")
    # Without teardown, CUPTI stays attached after profiling and slows every later kernel launch.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    traced = {}
    for phase, step in step_of.items():
        traced[phase] = profile_steps(step, phase, steps, device, out / "traces")
        progress(f"{phase}: profiled")
    profiles = []
    for phase, step in step_of.items():
        after_ms = _median_ms(step, OVERHEAD_ROUNDS * timing_steps, device)
        progress(f"{phase}: steps timed after the profiler")
        profiles.append(
            PhaseProfile(phase, steps, traced[phase][1], traced[phase][0], traced[phase][2], *timings[phase], after_ms)
        )
    records = [record(p, config, preset, batch, precision) for p in profiles]
    append_records(out / "results" / RESULTS_FILE, records)
    return profiles, records


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def render(profiles: list[PhaseProfile], records: list[dict]) -> str:
    first = records[0]
    unit = "GPU kernels" if first["gpu_kernels"] else "CPU operators (no GPU: aten self time)"
    lines = [
        f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · preset {first['preset']} · "
        f"batch {first['batch']} x context {first['context_length']} · {first['precision']} · attention "
        f"{first['attention']} · {first['steps']} profiled steps per phase · times are {unit}",
        "",
        "## Matrix multiplies vs other kernels",
        "",
        markdown_table(
            [
                {
                    "phase": r["phase"],
                    "ms": r["step_kernel_ms"],
                    **{k: 100 * v for k, v in r["category_shares"].items()},
                }
                for r in records
            ],
            [
                ("phase", "phase"),
                ("ms", "kernel ms / step"),
                ("matmul", "matmul %"),
                ("attention", "fused attention %"),
                ("other", "other %"),
            ],
        ),
    ]
    for profile, rec in zip(profiles, records, strict=True):
        lines += [
            "",
            f"## {profile.phase}: time per named range",
            "",
            "Each kernel counts once, in its innermost range: forward excludes the attention/* ranges nested in it.",
            "",
        ]
        ranges = [{"range": name, "ms": ms} for name, ms in rec["range_ms_per_step"].items() if ms > 0]
        lines.append(markdown_table(ranges, [("range", "range"), ("ms", "ms / step")]))
        for name, kernels in profile.summary.items():
            total = sum(s.total_us for s in kernels.values()) or 1.0
            top = sorted(kernels.values(), key=lambda s: -s.total_us)[:TOP_KERNELS]
            rows = [
                {
                    "name": _short(s.name),
                    "calls": s.calls,
                    "total_ms": s.total_us / 1e3,
                    "avg_us": s.average_us,
                    "share": 100 * s.total_us / total,
                }
                for s in top
            ]
            lines += [
                "",
                f"### {profile.phase} · {name} · top {len(rows)} of {len(kernels)}",
                "",
                markdown_table(
                    rows,
                    [
                        ("name", "kernel"),
                        ("calls", "calls"),
                        ("total_ms", "total ms"),
                        ("avg_us", "avg µs"),
                        ("share", "% of range"),
                    ],
                ),
            ]
        if rec["attention_stages"]:
            lines += [
                "",
                f"### {profile.phase} · attention stages (forward, all layers)",
                "",
                markdown_table(
                    rec["attention_stages"],
                    [
                        ("stage", "stage"),
                        ("ms_per_step", "ms / step"),
                        ("gflop_per_step", "GFLOP / step"),
                        ("tflops", "TFLOP/s"),
                        ("share_percent", "% of attention"),
                    ],
                ),
            ]
    lines += ["", "## Cost of the tool outside its window", ""]
    lines.append(
        markdown_table(
            [
                {
                    "phase": r["phase"],
                    "plain": r["plain_ms"],
                    "spread": r["plain_spread_percent"],
                    "annotated": r["annotated_overhead_percent"],
                    "after": r["after_profiler_overhead_percent"],
                }
                for r in records
            ],
            [
                ("phase", "phase"),
                ("plain", "plain step ms (median)"),
                ("spread", "plain rounds' spread, %"),
                ("annotated", "ranges on, % slower"),
                ("after", "after the profiler, % slower"),
            ],
        )
    )
    lines += [
        "",
        "A cost smaller than the plain rounds' spread is noise (negative ones too: those steps ran faster by chance).",
        "",
        "Chrome traces: " + ", ".join(f"`{p.trace}`" for p in profiles),
    ]
    return "\n".join(lines)
