"""`fastlm bench host`: the host (CPU) cost per call of each fastlm op against the PyTorch op it replaces.

At small shapes an op's GPU time is a few microseconds and what the host does per call (Python,
argument checks, autograd bookkeeping, the launches) sets the pace of a training step. Each case
calls the public function exactly as a user does, its float inputs requiring grad, next to the
plain-PyTorch code it replaces, in the same run. Target: fastlm's fwd+bwd host cost at
most 1.5x the PyTorch op's; under torch.compile, no more than Inductor's own kernels.

Protocol, per case x compile mode, for each implementation (pytorch, fastlm) and direction:
- fwd: ``fn(*inputs)`` with autograd recording; bwd: ``y.backward(dy)`` of a fresh forward run
  outside the timed region (retain_graph=False, so each forward is backpropagated once);
  fwd+bwd: ``fn(*inputs).backward(dy)``. The leaves' ``.grad`` is set to None before every
  backward, so backward assigns gradients instead of launching an accumulation kernel (inside
  the wall-clock loop that is one attribute store per leaf, the same for both implementations);
- warm-up excluded: ``warmup`` calls of every direction first (compilation, autotuning, first
  launches), then ``rounds`` rounds; in each round every (implementation, direction) is measured
  once, the implementations back to back, so a slow moment of the machine hits both;
- wall_us: ``calls`` calls back to back between two synchronizations, divided by ``calls`` (for
  bwd the ``calls`` forwards are run first): the throughput a host-bound training loop sees; GPU
  time shows only where it exceeds the host's;
- cpu_us: ``time.perf_counter_ns`` around each call alone, without synchronizing, the median
  over the round's calls: what one call costs the host;
- compile mode ``compile``: each implementation's one-line function under
  ``torch.compile(fullgraph=True, dynamic=False)``; its backward runs the compiled graph's
  backward. Python's garbage collector is off during a round (as in ``timeit``).
Each number is the median over rounds, with the min and max across rounds; a ratio is fastlm /
pytorch per round (measured back to back), summarized the same way. Records carry the launch
path (``fastlm.ops.launch.DIRECT_LAUNCH``; FASTLM_LAUNCH=triton gives "triton"), fixed per process, so
the report compares a run of each on the same GPU (a CPU launches no kernels: nothing to compare).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.bench.host_cases import CASES, HostCase
from fastlm.bench.options import (
    HOST_COMPILE_MODES,
    HOST_CPU_CALLS,
    HOST_CPU_ROUNDS,
    HOST_CPU_WARMUP,
    HOST_GPU_CALLS,
    HOST_GPU_ROUNDS,
    HOST_GPU_WARMUP,
    HOST_MIN_ROUNDS,
    HOST_OPS,
)
from fastlm.harness.benchmark import Benchmark, Implementation, Measured, Run, failure_status
from fastlm.harness.timing import drop_grads
from fastlm.ops.launch import DIRECT_LAUNCH
from fastlm.utils.plots import grouped_bar_plot
from fastlm.utils.records import latest_run, read_records, with_environment
from fastlm.utils.tables import device_line, markdown_table

# both take a case's inputs; one module-level function per op and implementation (host_cases)
IMPLEMENTATIONS = (
    Implementation("pytorch", lambda case: case.pytorch),
    Implementation("fastlm", lambda case: case.fastlm),
)
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
TARGET_RATIO = 1.5  # the bound fastlm aims for on its fwd+bwd host cost over PyTorch's
LAUNCH = "direct" if DIRECT_LAUNCH else "triton"
CPU_NOTE = (
    "No GPU on this machine: both implementations ran CPU reference paths (fastlm's plain-PyTorch "
    "fallbacks, or the Triton interpreter under TRITON_INTERPRET=1), not the Triton kernels, so these "
    "numbers say nothing about fastlm's host cost on a GPU, which is what this benchmark is for. Run "
    "`fastlm bench host --compile eager,compile` on a GPU machine."
)


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostCall:
    """What one measured call does: ``call(setup())`` after ``before()``; ``setup`` (untimed) makes
    the call's argument, e.g. the fresh forward whose output a backward consumes."""

    call: Callable[[object], object]
    setup: Callable[[], object] = lambda: None
    before: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Spread:
    median: float
    low: float  # min over rounds
    high: float  # max over rounds


def summarize(values: Iterable[float]) -> Spread:
    values = list(values)
    return Spread(statistics.median(values), min(values), max(values))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_round(host_call: HostCall, device: torch.device, calls: int) -> tuple[float, float]:
    """One round: (wall-clock us per call of ``calls`` calls back to back between two
    synchronizations, median us of ``perf_counter_ns`` around one call without synchronizing).
    ``setup`` is outside both timings; ``before`` is inside the wall-clock loop only."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        states = [host_call.setup() for _ in range(calls)]
        _synchronize(device)
        start = time.perf_counter_ns()
        for state in states:
            host_call.before()
            host_call.call(state)
        _synchronize(device)
        wall_us = (time.perf_counter_ns() - start) / calls / 1e3
        del states, state
        samples = []
        for _ in range(calls):
            state = host_call.setup()
            host_call.before()
            start = time.perf_counter_ns()
            host_call.call(state)
            samples.append(time.perf_counter_ns() - start)
        _synchronize(device)
    finally:
        if collecting:
            gc.enable()
    return wall_us, statistics.median(samples) / 1e3


def warm_up(host_calls: Iterable[HostCall], device: torch.device, count: int) -> None:
    """``count`` untimed calls of each: compilation, autotuning, first launches, allocator growth."""
    for host_call in host_calls:
        for _ in range(count):
            state = host_call.setup()
            host_call.before()
            host_call.call(state)
    _synchronize(device)


def measure_interleaved(
    host_calls: dict[Hashable, HostCall], device: torch.device, *, calls: int, rounds: int, warmup: int
) -> dict[Hashable, tuple[list[float], list[float]]]:
    """Per key, (wall us, cpu us) of each round (``host_round``), after ``warmup`` untimed calls of
    each; every round measures every key in order, so keys measured together share the machine's
    moments."""
    warm_up(host_calls.values(), device, warmup)
    times: dict[Hashable, tuple[list[float], list[float]]] = {key: ([], []) for key in host_calls}
    for _ in range(rounds):
        for key, host_call in host_calls.items():
            wall_us, cpu_us = host_round(host_call, device, calls)
            times[key][0].append(wall_us)
            times[key][1].append(cpu_us)
    return times


def direction_calls(fn: Callable[..., torch.Tensor], inputs: tuple, dy: torch.Tensor) -> dict[str, HostCall]:
    """fwd, bwd and fwd+bwd of ``fn(*inputs)`` with upstream gradient ``dy`` (see the protocol)."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    drop = lambda: drop_grads(leaves)
    return {
        "fwd": HostCall(lambda _: fn(*inputs)),
        "bwd": HostCall(lambda y: y.backward(dy), setup=lambda: fn(*inputs), before=drop),
        "fwd+bwd": HostCall(lambda _: fn(*inputs).backward(dy), before=drop),
    }


def _measure_case(case: HostCase, mode: str, device, dtype, *, calls, rounds, warmup) -> dict[str, dict]:
    """Per implementation: {"status": ...} and, when ok, {direction: (wall rounds, cpu rounds)}."""
    if mode == "compile" and device.type != "cuda":
        return {impl.name: {"status": "needs a GPU"} for impl in IMPLEMENTATIONS}
    results: dict[str, dict] = {}
    host_calls: dict[tuple[str, str], HostCall] = {}
    for impl in IMPLEMENTATIONS:
        fn = impl.make(case)
        if mode == "compile":
            fn = torch.compile(fn, fullgraph=True, dynamic=False)
        inputs = case.inputs(case.shape, device, dtype)
        try:
            dy = torch.randn_like(fn(*inputs))  # the first call: compiles in compile mode
            calls_of_impl = direction_calls(fn, inputs, dy)
            warm_up(calls_of_impl.values(), device, warmup)
        except Exception as error:  # noqa: BLE001 - a failing implementation is a row's status, not a crash
            results[impl.name] = {"status": failure_status(error)}
            continue
        results[impl.name] = {"status": "ok"}
        host_calls.update({(impl.name, direction): call for direction, call in calls_of_impl.items()})
    times = measure_interleaved(host_calls, device, calls=calls, rounds=rounds, warmup=0)
    for (name, direction), rounds_of_key in times.items():
        results[name][direction] = rounds_of_key
    return results


def _time_fields(wall_rounds: list[float], cpu_rounds: list[float]) -> dict:
    fields = {}
    for name, values in (("wall_us", wall_rounds), ("cpu_us", cpu_rounds)):
        spread = summarize(values)
        fields.update(
            {name: spread.median, f"{name}_min": spread.low, f"{name}_max": spread.high, f"{name}_rounds": values}
        )
    return fields


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------


def ratio(fastlm_record: dict, pytorch_record: dict, metric: str) -> Spread | None:
    """fastlm / pytorch of ``metric`` ("wall_us" or "cpu_us") per round, summarized; None when
    either was not measured."""
    if fastlm_record.get("status") != "ok" or pytorch_record.get("status") != "ok":
        return None
    pairs = zip(fastlm_record[f"{metric}_rounds"], pytorch_record[f"{metric}_rounds"], strict=True)
    return summarize(f / p for f, p in pairs)


def _us(record: dict, metric: str) -> str | None:
    if record.get("status") != "ok":
        return None
    return f"{record[metric]:.1f} ({record[f'{metric}_min']:.1f}–{record[f'{metric}_max']:.1f})"


def _times(spread: Spread | None) -> str | None:
    return None if spread is None else f"{spread.median:.2f}x ({spread.low:.2f}–{spread.high:.2f})"


TABLE_COLUMNS = [
    ("op", "op"),
    ("direction", "direction"),
    ("pytorch_wall", "pytorch wall us"),
    ("fastlm_wall", "fastlm wall us"),
    ("wall_ratio", "fastlm / pytorch, wall"),
    ("pytorch_cpu", "pytorch CPU us"),
    ("fastlm_cpu", "fastlm CPU us"),
    ("cpu_ratio", "fastlm / pytorch, CPU"),
    ("status", "status"),
]


def table_rows(records: list[dict]) -> list[dict]:
    """One row per op x direction of one compile mode's records."""
    by_key = {(r["op"], r["direction"], r["implementation"]): r for r in records}
    rows = []
    for op in dict.fromkeys(r["op"] for r in records):
        for direction in DIRECTIONS:
            pytorch, mine = by_key.get((op, direction, "pytorch"), {}), by_key.get((op, direction, "fastlm"), {})
            failed = [
                f"{impl}: {r.get('status', 'missing')}"
                for impl, r in (("pytorch", pytorch), ("fastlm", mine))
                if r.get("status") != "ok"
            ]
            rows.append(
                {
                    "op": op,
                    "direction": direction,
                    "pytorch_wall": _us(pytorch, "wall_us"),
                    "fastlm_wall": _us(mine, "wall_us"),
                    "wall_ratio": _times(ratio(mine, pytorch, "wall_us")),
                    "pytorch_cpu": _us(pytorch, "cpu_us"),
                    "fastlm_cpu": _us(mine, "cpu_us"),
                    "cpu_ratio": _times(ratio(mine, pytorch, "cpu_us")),
                    "status": "; ".join(failed) or "ok",
                }
            )
    return rows


def _fwd_bwd_ratios(records: list[dict], metric: str) -> dict[str, Spread | None]:
    by_key = {(r["op"], r["implementation"]): r for r in records if r["direction"] == "fwd+bwd"}
    ops = dict.fromkeys(r["op"] for r in records)
    return {op: ratio(by_key.get((op, "fastlm"), {}), by_key.get((op, "pytorch"), {}), metric) for op in ops}


def _verdict(ratios: dict[str, Spread | None], mode: str) -> str:
    measured = {op: s.median for op, s in ratios.items() if s is not None}
    if not measured:
        return f"No fwd+bwd pair measured in {mode} mode."
    within = [op for op, r in measured.items() if r <= TARGET_RATIO]
    worst = max(measured, key=measured.get)
    return (
        f"{mode}: fwd+bwd wall-clock host cost within {TARGET_RATIO}x of PyTorch's for {len(within)} of "
        f"{len(measured)} ops; highest {worst} at {measured[worst]:.2f}x."
    )


LAUNCH_ON_CPU = (
    "Launch paths are not compared on a CPU: its reference paths launch no kernel, so FASTLM_LAUNCH "
    "changes nothing there."
)
LAUNCH_HOW = (
    "To compare launch paths, run this again with FASTLM_LAUNCH={other} on this GPU: the path is fixed "
    "for a process when fastlm.ops is imported (each kernel's launcher is built then; switching it per "
    "call would add to the very cost measured here), and the report then puts that run next to this one."
)


def _launch_comparison(all_records: list[dict], latest: list[dict]) -> str:
    """fastlm's eager cost in the latest run next to the latest run on this GPU with the other
    launch path, or a sentence saying why there is no comparison (on a CPU: no launches; on a GPU:
    no run of the other path yet)."""
    first = latest[0]
    if first["gpu"] == "cpu":
        return LAUNCH_ON_CPU
    others = [
        r
        for r in all_records
        if r["gpu"] == first["gpu"]
        and r.get("launch", first["launch"]) != first["launch"]
        and r["implementation"] == "fastlm"
        and r["compile"] == "eager"
    ]
    how = LAUNCH_HOW.format(other="direct" if first["launch"] == "triton" else "triton")
    if not others:
        return how
    other = {(r["op"], r["direction"]): r for r in latest_run(others)}
    rows = []
    for r in latest:
        o = other.get((r["op"], r["direction"]))
        if r["implementation"] == "fastlm" and r["compile"] == "eager" and o is not None:
            rows.append(
                {
                    "op": r["op"],
                    "direction": r["direction"],
                    "this_wall": _us(r, "wall_us"),
                    "other_wall": _us(o, "wall_us"),
                    "this_cpu": _us(r, "cpu_us"),
                    "other_cpu": _us(o, "cpu_us"),
                }
            )
    if not rows:
        return how
    this, that = first["launch"], other[next(iter(other))]["launch"]
    columns = [
        ("op", "op"),
        ("direction", "direction"),
        ("this_wall", f"wall us, {this}"),
        ("other_wall", f"wall us, {that}"),
        ("this_cpu", f"CPU us, {this}"),
        ("other_cpu", f"CPU us, {that}"),
    ]
    when = next(iter(other.values()))["date"]
    return "\n\n".join(
        [f"## fastlm eager, launch path {this} vs {that} (the {that} run of {when})", markdown_table(rows, columns)]
    )


@dataclass(frozen=True)
class HostBenchmark(Benchmark):
    """Every case of ``ops`` (None: all of HOST_OPS) in every compile mode of ``modes``, bf16 on a GPU
    and fp32 on a CPU; ``rounds``, ``calls`` None: this device's defaults (fewer on a CPU). One record
    per case x mode x implementation x direction; the implementations of a case are measured
    together, round by round (the protocol above), so a progress step is a case in one mode."""

    ops: tuple[str, ...] | None = None
    modes: tuple[str, ...] = ("eager",)
    rounds: int | None = None
    calls: int | None = None

    name = "host"
    title = "Host cost per call: fastlm vs PyTorch"
    progress_name = "host cost"
    cpu_note = CPU_NOTE

    def __post_init__(self) -> None:
        if self.rounds is not None and self.rounds < HOST_MIN_ROUNDS:
            raise ValueError(f"rounds must be at least {HOST_MIN_ROUNDS}, got {self.rounds}")

    def cases(self, device: torch.device) -> list[HostCase]:
        return [CASES[op] for op in self.ops or HOST_OPS]

    def count(self, device: torch.device) -> int:
        return len(self.cases(device)) * len(self.modes)

    def measurements(self, run: Run) -> Iterator[Measured]:
        on_gpu = run.device.type == "cuda"
        dtype = torch.bfloat16 if on_gpu else torch.float32
        calls = self.calls or (HOST_GPU_CALLS if on_gpu else HOST_CPU_CALLS)
        rounds = self.rounds or (HOST_GPU_ROUNDS if on_gpu else HOST_CPU_ROUNDS)
        warmup = HOST_GPU_WARMUP if on_gpu else HOST_CPU_WARMUP
        for case in self.cases(run.device):
            for mode in self.modes:
                results = _measure_case(case, mode, run.device, dtype, calls=calls, rounds=rounds, warmup=warmup)
                records = []
                for impl in IMPLEMENTATIONS:
                    for direction in DIRECTIONS:
                        record = {
                            "op": case.op,
                            "shape": list(case.shape),
                            "dtype": str(dtype).removeprefix("torch."),
                            "implementation": impl.name,
                            "direction": direction,
                            "compile": mode,
                            "baseline": case.baseline,
                            "calls": calls,
                            "rounds": rounds,
                            "launch": LAUNCH,
                            "status": results[impl.name]["status"],
                        }
                        if direction in results[impl.name]:
                            record.update(_time_fields(*results[impl.name][direction]))
                        records.append(with_environment(record))
                yield Measured(f"{case.op} {mode}", records)

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown (a table and a fwd+bwd ratio plot per compile mode) of the latest host run."""
        all_records = read_records(results_dir / self.results_file)
        records = latest_run(all_records)
        if not records:
            return "No host-cost records yet: run `fastlm bench host`.\n"
        first = records[0]
        on_cpu = first["gpu"] == "cpu"
        parts = [
            f"{device_line(first)} · launch path {first['launch']} · {first['dtype']} · {first['calls']} calls x "
            f"{first['rounds']} rounds",
            *([f"**{CPU_NOTE}**"] if on_cpu else []),
            "Host microseconds per call, median over rounds (min–max across rounds). wall: calls back to back "
            "between two synchronizations, divided by their number; CPU: the call alone, timed without "
            "synchronizing (median over a round's calls). bwd is the backward alone, after an untimed forward. "
            f"Ratio: fastlm / pytorch per round (below 1: fastlm costs the host less); target fwd+bwd <= "
            f"{TARGET_RATIO}x.",
            markdown_table(
                [
                    {"op": op, "shape": "x".join(map(str, r["shape"])), "baseline": f"`{r['baseline']}`"}
                    for op, r in {r["op"]: r for r in records}.items()
                ],
                [("op", "op"), ("shape", "shape"), ("baseline", "pytorch: the code fastlm replaces")],
            ),
        ]
        for mode in HOST_COMPILE_MODES:
            mine = [r for r in records if r["compile"] == mode]
            title = "eager" if mode == "eager" else "torch.compile(fullgraph=True), both implementations"
            if not any(r["status"] == "ok" for r in mine):
                if mine:
                    statuses = ", ".join(dict.fromkeys(r["status"] for r in mine))
                    parts += [f"## {title}", f"Not measured: {statuses}."]
                continue
            ratios = {metric: _fwd_bwd_ratios(mine, metric) for metric in ("wall_us", "cpu_us")}
            label = "CPU reference paths" if on_cpu else first["gpu"]
            plot = grouped_bar_plot(
                reports_dir / f"host_fwd_bwd_ratio_{mode}.png",
                list(ratios["wall_us"]),
                {
                    name: [None if s is None else s.median for s in ratios[metric].values()]
                    for name, metric in (("wall-clock per call", "wall_us"), ("CPU time of the call", "cpu_us"))
                },
                ylabel="fwd+bwd host cost, fastlm / pytorch",
                title=f"Host cost per fwd+bwd call, {mode} ({label})",
                reference_lines=[(TARGET_RATIO, f"target {TARGET_RATIO}x"), (1.0, "parity")],
            )
            parts += [
                f"## {title}",
                markdown_table(table_rows(mine), TABLE_COLUMNS),
                _verdict(ratios["wall_us"], mode),
                f"![fwd+bwd host cost ratio, {mode}]({plot.name})",
            ]
        parts.append(_launch_comparison(all_records, records))
        return "\n\n".join(parts)
