"""`fastlm bench ddp`: the data-parallel training step of the LM for each way of synchronizing
gradients: step time, time spent communicating (measured on the GPU timeline), how much of it
backward hides, and the memory of optimizer-state sharding.

One process per rank (NCCL with one GPU each, or gloo on CPU); each rank builds the model (same
seed), takes its own random batch of `batch` sequences, runs forward under bf16 autocast (or fp32),
backward, gradient synchronization and AdamW (fused on CUDA). Every variant gets a fresh model.

Variants
    no-sync       no gradient averaging: the compute-only step every variant is compared with
    naive, flat   `allreduce_gradients` after backward, per parameter / flattened
    ddp           fastlm `DDP`: an async all-reduce per parameter, started from its gradient hook
    bucketed-X    fastlm `BucketedDDP(bucket_size_mb=X)`
    torch-ddp     PyTorch `DistributedDataParallel` (its defaults: 25 MB buckets)

Step time: `warmup` untimed steps, then `steps` timed ones between synchronizes; a step's time is
the slowest rank's; rows give the median.

Communication (GPU): `profile_steps` more steps under torch.profiler, after a barrier. On each
rank's GPU timeline every NCCL kernel is communication and every other kernel (and copy) compute;
a kernel's phase (forward / backward / sync / optimizer) is the range in which its launch was
issued. An NCCL kernel that starts before its peers spins until the last one arrives, so the
collective's communication is taken to run from the latest start over the ranks (the k-th NCCL
kernel of every rank is the same collective; profiler clocks are the host's, shared by the ranks)
to its end on rank 0. On rank 0's timeline:
    comm_ms                  union of those communication intervals, per step
    comm_kernel_ms           union of rank 0's NCCL kernels themselves (waiting included), per step
    hidden_behind_backward   share of comm_ms inside a backward window: from a step's first to its
                             last backward kernel (communication there does not delay the step)
    exposed_comm_ms          comm time outside the backward windows, per step
    profiled_step_ms         the profiled steps' GPU span per step: the profiler's own CPU cost
                             slows launch-bound steps, which the timed steps do not pay
A Chrome trace (gzip) per variant lands in `trace_dir`.

Memory (GPU, optimizers `adamw` / `sharded` / `zero`, all with `BucketedDDP(bucket_mb)`): memory
allocated after construction, at the start of a step (optimizer state exists after the warm-up),
after forward, before and after the optimizer step, and the peak; the breakdown into parameters,
gradients, this rank's optimizer state and activations (after forward minus start of step); the
step time. `sharded` is fastlm's `ShardedOptimizer`, `zero` PyTorch's `ZeroRedundancyOptimizer`.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import timeit
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from fastlm.bench.options import DDP_OPTIMIZERS
from fastlm.distributed import DDP, BucketedDDP, ShardedOptimizer, allreduce_gradients
from fastlm.distributed.launch import spawn
from fastlm.harness.plots import grouped_bar_plot, save_figure
from fastlm.harness.records import append_records, latest_runs_by, read_records, with_environment
from fastlm.harness.tables import markdown_table, present_columns, si_seconds
from fastlm.model import ModelConfig, TransformerLM
from fastlm.profile.ranges import annotate, annotations

RESULTS_FILE = "ddp.jsonl"
TIMELINES_FILE = "ddp_timelines.jsonl"  # in the trace folder: the GPU timelines the overlap plots draw
GLOO_NOTE = (
    "gloo on CPU: no NCCL kernels and no GPU timeline, so communication time, its overlap with the "
    "backward and the memory columns are not measured; the step times are of CPU processes sharing "
    "this machine's cores and say nothing about GPUs."
)
PHASES = ("forward", "backward", "sync", "optimizer")
MB = 1e6


@dataclass(frozen=True)
class Settings:
    preset: str = "xl"
    context: int = 512
    batch: int = 4  # sequences per rank
    vocab: int = 10000
    precision: str = "bf16"
    warmup: int = 3
    steps: int = 10  # timed steps per variant and round
    rounds: int = 2  # passes over the variants (each with fresh models): round-to-round drift shows
    profile_steps: int = 2
    bucket_mb: float = 25.0  # for the memory rows
    trace_dir: str | None = None


# ---------------------------------------------------------------------------------------------
# The GPU timeline: intervals, overlap
# ---------------------------------------------------------------------------------------------

Interval = tuple[float, float]  # (start, end), ms


def merge(intervals: Sequence[Interval], gap: float = 0.0) -> list[Interval]:
    """The union of ``intervals`` as sorted disjoint intervals; pieces closer than ``gap`` join."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Sequence[Interval]) -> float:
    return sum(end - start for start, end in merge(intervals))


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Total length of (union of a) ∩ (union of b)."""
    a, b = merge(a), merge(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass
class Timeline:
    """GPU work of the profiled steps (host clock, ms): communication and compute by phase."""

    comm: list[Interval]
    compute: dict[str, list[Interval]]  # phase -> intervals ("other" when launched outside a phase)

    def shifted(self, origin: float) -> Timeline:
        def shift(intervals):
            return [(a - origin, b - origin) for a, b in intervals]

        return Timeline(shift(self.comm), {phase: shift(ivs) for phase, ivs in self.compute.items()})

    def phase_windows(self, phase: str) -> list[Interval]:
        """Each stretch of the timeline from a first to a last kernel of ``phase`` with no kernel
        of another phase in between (one backward window per step), idle gaps included."""
        kernels = sorted((iv, name) for name, intervals in self.compute.items() for iv in intervals)
        windows: list[Interval] = []
        previous = None
        for (start, end), name in kernels:
            if name == phase and previous == phase:
                windows[-1] = (windows[-1][0], max(windows[-1][1], end))
            elif name == phase:
                windows.append((start, end))
            previous = name
        return windows

    def summary(self, steps: int) -> dict:
        total = length(self.comm)
        if total == 0:
            return {"comm_ms": 0.0, "hidden_behind_backward": None, "exposed_comm_ms": 0.0}
        hidden = intersection(self.comm, self.phase_windows("backward"))
        return {"comm_ms": total / steps, "hidden_behind_backward": hidden / total,
                "exposed_comm_ms": (total - hidden) / steps}  # fmt: skip

    def compact(self, gap: float = 0.02) -> dict:
        """Merged intervals (pieces closer than ``gap`` ms join), rounded: small enough for a record."""

        def rounded(intervals):
            return [(round(a, 3), round(b, 3)) for a, b in merge(intervals, gap)]

        return {"comm": rounded(self.comm), **{phase: rounded(ivs) for phase, ivs in self.compute.items()}}


def _innermost(ranges: list[tuple[int, int, str]], t: int) -> str:
    containing = [(end - start, name) for start, end, name in ranges if start <= t <= end]
    return min(containing)[1] if containing else "other"


def gpu_timeline(events) -> Timeline:
    """From ``profiler.kineto_results.events()``: GPU kernels and copies, linked to the CPU call
    that launched them (correlation id) and through its time to a phase range."""
    cpu = [e for e in events if e.device_type() == DeviceType.CPU]
    ranges = [(e.start_ns(), e.end_ns(), e.name()) for e in cpu if e.name() in PHASES]
    launched_at = {e.correlation_id(): e.start_ns() for e in cpu if e.correlation_id()}
    gpu = [e for e in events if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()]
    timeline = Timeline([], {})
    for e in gpu:
        interval = (e.start_ns() / 1e6, e.end_ns() / 1e6)
        if "nccl" in e.name().lower():
            timeline.comm.append(interval)
        else:
            phase = _innermost(ranges, launched_at.get(e.correlation_id(), -1))
            timeline.compute.setdefault(phase, []).append(interval)
    timeline.comm.sort()
    return timeline


def collective_intervals(comm_per_rank: Sequence[Sequence[Interval]]) -> list[Interval] | None:
    """Rank 0's NCCL kernels cut to when the collective can move data: from the latest start of
    the k-th kernel over the ranks to rank 0's end. None when the ranks' kernel counts differ."""
    if len({len(c) for c in comm_per_rank}) != 1:
        return None
    return [
        (min(max(kernels[0] for kernels in same), same[0][1]), same[0][1]) for same in zip(*comm_per_rank, strict=True)
    ]


# ---------------------------------------------------------------------------------------------
# One rank's measurements
# ---------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build_model(settings: Settings, device: torch.device) -> TransformerLM:
    torch.manual_seed(0)  # the same weights on every rank, also for the variants that do not broadcast
    config = ModelConfig.preset(settings.preset, vocab_size=settings.vocab, context_length=settings.context)
    with torch.device(device):
        return TransformerLM(config)


def _wrap(variant: str, model: torch.nn.Module, device: torch.device) -> tuple[torch.nn.Module, Callable]:
    """(the module to call, the synchronization to run after backward)."""
    if variant == "ddp":
        wrapped = DDP(model)
        return wrapped, wrapped.finish_gradient_synchronization
    if variant.startswith("bucketed-"):
        wrapped = BucketedDDP(model, float(variant.removeprefix("bucketed-")))
        return wrapped, wrapped.finish_gradient_synchronization
    if variant == "torch-ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids), lambda: None
    if variant in ("naive", "flat"):
        return model, lambda: allreduce_gradients(model, flat=variant == "flat")
    return model, lambda: None


def make_optimizer(name: str, params, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA) unsharded, as fastlm's ShardedOptimizer, or as PyTorch's ZeRO-1."""
    options = {"lr": 1e-4, "fused": device.type == "cuda"}
    if name == "adamw":
        return torch.optim.AdamW(params, **options)
    if name == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, **options)
    if name == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **options)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(DDP_OPTIMIZERS)}")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (the local share of a sharded one)."""
    local = getattr(optimizer, "local", None) or getattr(optimizer, "optim", None) or optimizer
    return sum(
        value.numel() * value.element_size()
        for state in local.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


class _Run:
    """One rank's model, wrapper, optimizer, batch and step function for one row."""

    def __init__(self, settings: Settings, variant: str, optimizer: str, rank: int, device: torch.device) -> None:
        self.device = device
        self.model = _build_model(settings, device)
        self.wrapped, self.sync = _wrap(variant, self.model, device)
        self.optimizer = make_optimizer(optimizer, self.model.parameters(), device)
        generator = torch.Generator().manual_seed(1000 + rank)
        tokens = torch.randint(0, settings.vocab, (settings.batch, settings.context + 1), generator=generator)
        self.tokens, self.targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.precision == "bf16")

    def forward(self) -> torch.Tensor:
        with annotate("forward"), self.autocast:
            return self.wrapped(self.tokens, self.targets)

    def finish(self, loss: torch.Tensor) -> None:
        with annotate("backward"):
            loss.backward()
        with annotate("sync"):
            self.sync()
        with annotate("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.finish(self.forward())

    def timed_steps(self, steps: int) -> list[float]:
        """Seconds per step, each the slowest rank's."""
        times = []
        for _ in range(steps):
            _synchronize(self.device)
            start = timeit.default_timer()
            self.step()
            _synchronize(self.device)
            times.append(timeit.default_timer() - start)
        slowest = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.tolist()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None


def _timing_fields(settings: Settings, times: list[float], world: int) -> dict:
    median = statistics.median(times)
    return {"median_ms": median * 1e3, "mean_ms": statistics.mean(times) * 1e3,
            "tokens_per_s": settings.batch * settings.context * world / median}  # fmt: skip


def _profile(run: _Run, settings: Settings, name: str, rank: int) -> dict:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _synchronize(run.device)
    dist.barrier()
    with annotations(), torch.profiler.profile(activities=activities) as profiler:
        for _ in range(settings.profile_steps):
            run.step()
        _synchronize(run.device)
    if rank == 0 and settings.trace_dir:
        Path(settings.trace_dir).mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(Path(settings.trace_dir) / f"{name}.json.gz"))
    timeline = gpu_timeline(profiler.profiler.kineto_results.events())
    comm_per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(comm_per_rank, timeline.comm)
    if not timeline.comm and not timeline.compute:
        return {}  # no GPU timeline (gloo on CPU)
    kernel_ms = length(timeline.comm) / settings.profile_steps
    collectives = collective_intervals(comm_per_rank)
    if collectives is not None:
        timeline.comm = collectives
    everything = timeline.comm + [iv for ivs in timeline.compute.values() for iv in ivs]
    timeline = timeline.shifted(min(a for a, _ in everything))
    span = max(b for _, b in everything) - min(a for a, _ in everything)
    return {**timeline.summary(settings.profile_steps), "comm_kernel_ms": kernel_ms,
            "profiled_step_ms": span / settings.profile_steps, "comm_aligned_across_ranks": collectives is not None,
            "timeline": timeline.compact()}  # fmt: skip


def _variant_steps(settings: Settings, variant: str, rank: int, world: int, device: torch.device,
                   profile: bool) -> tuple[list[float], dict]:  # fmt: skip
    """Timed step seconds (slowest rank) of a fresh model, and the profile fields when asked."""
    run = _Run(settings, variant, "adamw", rank, device)
    for _ in range(settings.warmup):
        run.step()
    times = run.timed_steps(settings.steps)
    return times, _profile(run, settings, f"ddp_{variant}_x{world}", rank) if profile else {}


def _memory_row(settings: Settings, optimizer: str, rank: int, world: int, device: torch.device) -> dict:
    run = _Run(settings, f"bucketed-{settings.bucket_mb:g}", optimizer, rank, device)
    row = {"init_bytes": run.allocated()}
    for _ in range(max(1, settings.warmup)):  # the first step allocates the optimizer state
        run.step()
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row["step_start_bytes"] = run.allocated()
    loss = run.forward()
    row["after_forward_bytes"] = run.allocated()
    loss.backward()
    run.sync()
    row["before_step_bytes"] = run.allocated()
    row["grads_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in run.model.parameters()
                             if p.grad is not None)  # fmt: skip
    run.optimizer.step()
    row["after_step_bytes"] = run.allocated()
    run.optimizer.zero_grad(set_to_none=True)
    row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    row["params_bytes"] = sum(p.numel() * p.element_size() for p in run.model.parameters())
    row["optimizer_state_bytes"] = optimizer_state_bytes(run.optimizer)
    if device.type == "cuda":
        row["activations_bytes"] = row["after_forward_bytes"] - row["step_start_bytes"]
    row.update(_timing_fields(settings, run.timed_steps(settings.steps), world))
    return row


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _worker(rank: int, world: int, backend: str, settings: Settings, variants, optimizers, out: str,
            progress: Callable[[str], None] | None) -> None:  # fmt: skip
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # without teardown CUPTI stays attached after a profile and slows every later kernel launch
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    profiles: dict[str, dict] = {}
    for round_index in range(settings.rounds):
        for variant in variants:
            measured, profile = _variant_steps(settings, variant, rank, world, device, profile=round_index == 0)
            times[variant].append(measured)
            if rank == 0 and progress is not None:
                progress(f"data-parallel steps, {world} processes, round {round_index + 1}/{settings.rounds}: "
                         f"{variant} {si_seconds(statistics.median(measured))} per step")  # fmt: skip
            profiles.setdefault(variant, profile)
            _release(device)
            dist.barrier()
    rows = [
        {"kind": "step", "variant": v, **_timing_fields(settings, [t for r in times[v] for t in r], world),
         "round_median_ms": [statistics.median(r) * 1e3 for r in times[v]], **profiles[v], "status": "ok"}
        for v in variants
    ]  # fmt: skip
    # no out-of-memory rows here: a rank that skipped ahead would pair its collectives with another
    # rank's unfinished step; an OOM ends the run with PyTorch's error instead
    for optimizer in optimizers:
        rows.append({"kind": "memory", "optimizer": optimizer, **_memory_row(settings, optimizer, rank, world, device),
                     "status": "ok"})  # fmt: skip
        if rank == 0 and progress is not None:
            progress(f"data-parallel steps, {world} processes: memory row of {optimizer}, "
                     f"{si_seconds(rows[-1]['median_ms'] * 1e-3)} per step")  # fmt: skip
        _release(device)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure(backend: str, world: int, settings: Settings, variants: Sequence[str],
            optimizers: Sequence[str], progress: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """Every variant and optimizer for one (backend, world size): the records (rank 0's view). Rank 0
    calls ``progress`` after each variant of each round and after each memory row."""
    common = {"op": "ddp", "backend": backend, "world": world, **asdict(settings)}
    common.pop("trace_dir")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        spawn(_worker, world, world, backend, settings, tuple(variants), tuple(optimizers), out, progress,
              backend=backend)  # fmt: skip
        return [with_environment({**common, **row}) for row in json.loads(Path(out).read_text())]


def run(backend: str, worlds: Sequence[int], settings: Settings, variants: Sequence[str], optimizers: Sequence[str],
        results_dir: Path, progress: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """Every world size in turn; appends and returns the records. ``progress`` gets a line as each
    world size starts and, from its rank 0, one per variant and round and per memory row."""
    records = []
    for world in worlds:
        if progress is not None:
            progress(f"data-parallel steps, {world} processes ({backend}, {settings.preset}): {len(variants)} "
                     f"variants x {settings.rounds} rounds, then {len(optimizers)} memory rows")  # fmt: skip
        measured = measure(backend, world, settings, variants, optimizers, progress)
        timelines = [_take_timeline(record) for record in measured if "timeline" in record]
        if timelines and settings.trace_dir:  # bulky (megabytes per run): kept beside the traces, not in git
            append_records(Path(settings.trace_dir) / TIMELINES_FILE, timelines)
        append_records(results_dir / RESULTS_FILE, measured)
        records += measured
    return records


def _take_timeline(record: dict) -> dict:
    """Removes ``record``'s GPU timeline and returns it keyed by (run_id, world, variant)."""
    return {"run_id": record["run_id"], "world": record["world"], "variant": record["variant"],
            "timeline": record.pop("timeline")}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

STEP_COLUMNS = [("world", "ranks"), ("variant", "variant"), ("median_ms", "step ms (median)"),
                ("vs_torch_ddp", "vs torch-ddp"), ("tokens_per_s", "tokens/s"), ("comm_ms", "comm ms"),
                ("comm_kernel_ms", "NCCL kernel ms"), ("rounds_ms", "per-round medians ms"),
                ("spread_percent", "round spread %"), ("profiled_step_ms", "profiled step ms"),
                ("hidden_percent", "comm hidden behind bwd %"), ("exposed_comm_ms", "exposed comm ms"),
                ("status", "status")]  # fmt: skip
MEMORY_COLUMNS = [("world", "ranks"), ("optimizer", "optimizer"), ("init_mb", "after init MB"),
                  ("before_step_mb", "before step MB"), ("after_step_mb", "after step MB"), ("peak_mb", "peak MB"),
                  ("params_mb", "params MB"), ("grads_mb", "grads MB"), ("optimizer_state_mb", "opt. state MB"),
                  ("state_vs_adamw", "state vs adamw"), ("activations_mb", "activations MB"),
                  ("median_ms", "step ms"), ("status", "status")]  # fmt: skip


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
        reference = next((t for t in records if t["kind"] == "step" and t["variant"] == "torch-ddp"
                          and t["world"] == r["world"] and t.get("median_ms")), None)  # fmt: skip
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
        row = {**r, **{key.replace("_bytes", "_mb"): value / MB for key, value in r.items()
                       if key.endswith("_bytes") and value is not None}}  # fmt: skip
        unsharded = next((t for t in records if t["kind"] == "memory" and t["optimizer"] == "adamw"
                          and t["world"] == r["world"] and t.get("optimizer_state_bytes")), None)  # fmt: skip
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
    colours = {"forward": "tab:blue", "backward": "tab:green", "sync": "tab:red", "optimizer": "tab:purple",
               "other": "tab:gray", "comm": "tab:orange"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(timed) + 1.5))
    for i, record in enumerate(reversed(timed)):
        y = 2 * i
        for lane, intervals in record["timeline"].items():
            offset = 0.0 if lane == "comm" else 0.9
            bars = [(a, b - a) for a, b in intervals]
            ax.broken_barh(bars, (y + offset, 0.8), color=colours.get(lane, "tab:gray"), linewidth=0)
    ax.set_yticks([2 * i + 0.9 for i in range(len(timed))], [r["variant"] for r in reversed(timed)])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, [name if name != "comm" else "NCCL (lower lane)" for name in colours], fontsize=7,
              ncols=6, loc="upper center", bbox_to_anchor=(0.5, -0.12))  # fmt: skip
    ax.set_xlabel("ms since the first kernel of the profiled steps")
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def render(results_dir: Path, reports_dir: Path) -> str:
    """One section per number of ranks, from the latest run that measured it (a later 8-rank run
    does not hide the 2- and 4-rank rows of an earlier one); each section's tables come from one run.
    The overlap plots need the GPU timelines in ``<out>/traces`` (beside results/); without them a
    plot already in ``reports_dir`` is shown as it is."""
    runs = latest_runs_by(read_records(results_dir / RESULTS_FILE), "world")
    if not runs:
        return "No data-parallel records yet: run `fastlm bench ddp`.\n"
    timelines = {(t["run_id"], t["world"], t["variant"]): t["timeline"]
                 for t in read_records(results_dir.parent / "traces" / TIMELINES_FILE)}  # fmt: skip
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
        lines += ["### Step time and communication", "", markdown_table(steps, present_columns(steps, STEP_COLUMNS)),
                  ""]  # fmt: skip
        variants = list(dict.fromkeys(r["variant"] for r in steps))
        series = {f"{w} ranks": [next((r.get("median_ms") for r in steps if r["world"] == w and r["variant"] == v),
                                      None) for v in variants] for w in worlds}  # fmt: skip
        bars = grouped_bar_plot(reports_dir / f"ddp_step_ms_x{tag}.png", variants, series, ylabel="step ms (median)",
                                title=f"Data-parallel training step · {first['preset']} · {first['gpu']}")  # fmt: skip
        lines += [f"![step time per variant, {tag} ranks]({bars.name})", ""]
        for world in worlds:
            timed = [r for r in steps if r["world"] == world and r.get("timeline")]
            plot = reports_dir / f"ddp_overlap_x{world}.png"
            if timed:
                plot = overlap_plot(plot, timed, f"GPU timeline of {first['profile_steps']} steps, rank 0 of {world}: "
                                    "compute by phase (upper lane) and NCCL (lower lane)")  # fmt: skip
            if plot.exists() and first["backend"] == "nccl":  # gloo runs have no GPU timeline
                lines += [f"![communication overlap, {world} ranks]({plot.name})", ""]
    memory = _memory_rows(records)
    if memory:
        lines += ["### Memory per rank: optimizer-state sharding", "",
                  markdown_table(memory, present_columns(memory, MEMORY_COLUMNS)), ""]  # fmt: skip
    return lines
