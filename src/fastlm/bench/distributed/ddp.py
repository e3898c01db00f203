"""`fastlm bench ddp`: the data-parallel training step of the LM for each way of synchronizing
gradients: step time, time spent communicating (measured on the GPU timeline), how much of it
backward hides, and the memory of optimizer-state sharding.

One process per rank (NCCL with one GPU each, or gloo on CPU); each rank builds the model (same
seed), takes its own random batch of `batch` sequences, runs forward under bf16 autocast (or fp32),
backward, gradient synchronization and AdamW (fused on CUDA). Every variant gets a fresh model.

Variants (their wrappers: `fastlm.distributed.wrappers`)
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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastlm.bench.distributed.ddp_report import GLOO_NOTE, TIMELINES_FILE, render
from fastlm.bench.distributed.options import DDP_OPTIMIZERS, Variant
from fastlm.bench.distributed.timeline import collective_intervals, gpu_timeline, length
from fastlm.bench.distributed.worlds import WorldSizesBenchmark
from fastlm.distributed.launch import spawn
from fastlm.distributed.sharded_optimizer import ShardedOptimizer
from fastlm.distributed.wrappers import ParallelSpec, wrap
from fastlm.harness.benchmark import Measured, Run
from fastlm.layers.ranges import annotate, annotations
from fastlm.model import ModelConfig, TransformerLM
from fastlm.utils.progress import heartbeat, print_line
from fastlm.utils.records import append_records, with_environment
from fastlm.utils.tables import si_seconds


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

    def __init__(self, settings: Settings, spec: ParallelSpec, optimizer: str, rank: int, device: torch.device) -> None:
        self.device = device
        self.model = _build_model(settings, device)
        wrapped = wrap(self.model, spec, device)
        self.wrapped, self.sync = wrapped.module, wrapped.synchronize
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
    return {
        "median_ms": median * 1e3,
        "mean_ms": statistics.mean(times) * 1e3,
        "tokens_per_s": settings.batch * settings.context * world / median,
    }


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
    return {
        **timeline.summary(settings.profile_steps),
        "comm_kernel_ms": kernel_ms,
        "profiled_step_ms": span / settings.profile_steps,
        "comm_aligned_across_ranks": collectives is not None,
        "timeline": timeline.compact(),
    }


def _variant_steps(
    settings: Settings, variant: Variant, rank: int, world: int, device: torch.device, profile: bool
) -> tuple[list[float], dict]:
    """Timed step seconds (slowest rank) of a fresh model, and the profile fields when asked."""
    run = _Run(settings, variant.spec, "adamw", rank, device)
    for _ in range(settings.warmup):
        run.step()
    times = run.timed_steps(settings.steps)
    return times, _profile(run, settings, f"ddp_{variant.name}_x{world}", rank) if profile else {}


def _memory_row(settings: Settings, optimizer: str, rank: int, world: int, device: torch.device) -> dict:
    run = _Run(settings, ParallelSpec("bucketed", settings.bucket_mb), optimizer, rank, device)
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
    row["grads_bytes"] = sum(
        p.grad.numel() * p.grad.element_size() for p in run.model.parameters() if p.grad is not None
    )
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


def _worker(
    rank: int,
    world: int,
    backend: str,
    settings: Settings,
    variants: tuple[Variant, ...],
    optimizers: tuple[str, ...],
    out: str,
) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # without teardown CUPTI stays attached after a profile and slows every later kernel launch
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    times: dict[str, list[list[float]]] = {v.name: [] for v in variants}
    profiles: dict[str, dict] = {}
    for round_index in range(settings.rounds):
        for variant in variants:
            measured, profile = _variant_steps(settings, variant, rank, world, device, profile=round_index == 0)
            times[variant.name].append(measured)
            if rank == 0:
                print_line(
                    f"data-parallel steps, {world} processes, round {round_index + 1}/{settings.rounds}: "
                    f"{variant.name} {si_seconds(statistics.median(measured))} per step"
                )
            profiles.setdefault(variant.name, profile)
            _release(device)
            dist.barrier()
    rows = [
        {
            "kind": "step",
            "variant": v,
            **_timing_fields(settings, [t for r in times[v] for t in r], world),
            "round_median_ms": [statistics.median(r) * 1e3 for r in times[v]],
            **profiles[v],
            "status": "ok",
        }
        for v in times
    ]
    # no out-of-memory rows here: a rank that skipped ahead would pair its collectives with another
    # rank's unfinished step; an OOM ends the run with PyTorch's error instead
    for optimizer in optimizers:
        rows.append(
            {
                "kind": "memory",
                "optimizer": optimizer,
                **_memory_row(settings, optimizer, rank, world, device),
                "status": "ok",
            }
        )
        if rank == 0:
            print_line(
                f"data-parallel steps, {world} processes: memory row of {optimizer}, "
                f"{si_seconds(rows[-1]['median_ms'] * 1e-3)} per step"
            )
        _release(device)
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure(
    backend: str, world: int, settings: Settings, variants: Sequence[Variant], optimizers: Sequence[str]
) -> list[dict]:
    """Every variant and optimizer for one (backend, world size): the records (rank 0's view). Rank 0
    prints a line after each variant of each round and after each memory row."""
    common = {"op": "ddp", "backend": backend, "world": world, **asdict(settings)}
    common.pop("trace_dir")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        # a variant's steps on CPU processes sharing 2 cores can take minutes between rank 0's lines
        with heartbeat(lambda running_s: f"data-parallel steps, {world} processes: running for {running_s:.0f} s"):
            spawn(_worker, world, world, backend, settings, tuple(variants), tuple(optimizers), out, backend=backend)
        return [with_environment({**common, **row}) for row in json.loads(Path(out).read_text())]


def _take_timeline(record: dict) -> dict:
    """Removes ``record``'s GPU timeline and returns it keyed by (run_id, world, variant)."""
    return {
        "run_id": record["run_id"],
        "world": record["world"],
        "variant": record["variant"],
        "timeline": record.pop("timeline"),
    }


@dataclass(frozen=True)
class DataParallelBenchmark(WorldSizesBenchmark):
    """Every world size in turn, each in its own processes: the variants' steps, then the memory
    rows. Rank 0 of each world prints the progress lines."""

    settings: Settings
    variants: tuple[Variant, ...]
    optimizers: tuple[str, ...]

    name = "ddp"
    title = "Data-parallel training benchmark"
    gloo_note = GLOO_NOTE

    def measurements(self, run: Run) -> Iterator[Measured]:
        settings = self.settings
        for world in self.worlds:
            print_line(
                f"data-parallel steps, {world} processes ({self.backend}, {settings.preset}): "
                f"{len(self.variants)} variants x {settings.rounds} rounds, then {len(self.optimizers)} "
                "memory rows"
            )
            measured = measure(self.backend, world, settings, self.variants, self.optimizers)
            timelines = [_take_timeline(record) for record in measured if "timeline" in record]
            if timelines and settings.trace_dir:  # bulky (megabytes per run): kept beside the traces, not in git
                append_records(Path(settings.trace_dir) / TIMELINES_FILE, timelines)
            yield Measured(f"{world} processes", measured)

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        return render(results_dir, reports_dir)
