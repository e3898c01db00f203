"""`fastlm bench allreduce`: all-reduce time and bandwidth vs tensor size and number of processes.

One process per rank (torch.multiprocessing, localhost rendezvous), gloo on CPU tensors or NCCL with
one GPU per rank. For each float32 tensor size: `warmup` untimed all-reduces, then `iters` timed
ones, each between a barrier and a synchronize, timed on every rank; an iteration's time is the
slowest rank's (all-reduce MAX of the per-rank times), the row reports the median over iterations.

    algbw = bytes / time
    busbw = algbw * 2 (n - 1) / n     (the traffic each link carries in a ring all-reduce, so
                                       busbw is comparable across n and against link bandwidth)
"""

from __future__ import annotations

import ast
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fastlm.bench.distributed.worlds import WorldSizesBenchmark
from fastlm.distributed.launch import spawn
from fastlm.harness.benchmark import Measured, Run
from fastlm.utils.plots import line_plot
from fastlm.utils.progress import print_line
from fastlm.utils.records import latest_run, read_records, with_environment
from fastlm.utils.tables import markdown_table, si, si_seconds

GLOO_NOTE = (
    "gloo on CPU tensors: these all-reduces go through host memory and loopback TCP, not NCCL over "
    "NVLink or PCIe; their bandwidths say nothing about GPUs."
)


def bus_bandwidth(algbw: float, world: int) -> float:
    return algbw * 2 * (world - 1) / world


def _worker(rank: int, world: int, backend: str, sizes_mb, warmup: int, iters: int, out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for size_mb in sizes_mb:
        data = torch.ones(int(size_mb * 1e6) // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            sync()
            start = time.perf_counter()
            dist.all_reduce(data)
            sync()
            elapsed = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(elapsed.item())
        median = statistics.median(times)
        algbw = data.numel() * 4 / median / 1e9
        rows.append(
            {
                "backend": backend,
                "world": world,
                "size_mb": size_mb,
                "iters": iters,
                "median_ms": median * 1e3,
                "algbw_gbps": algbw,
                "busbw_gbps": bus_bandwidth(algbw, world),
            }
        )
        if rank == 0:
            print_line(
                f"all-reduce, {world} processes, {size_mb:g} MB: {si_seconds(median)}, "
                f"busbw {si(bus_bandwidth(algbw, world) * 1e9, 'B/s')}"
            )
        del data
    if rank == 0:
        Path(out).write_text(repr(rows))


def measure(backend: str, world: int, sizes_mb, *, warmup: int = 5, iters: int = 10) -> list[dict]:
    """All sizes for one (backend, world size); returns the records (rank 0's view). Rank 0 prints a
    line after each size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        spawn(_worker, world, world, backend, tuple(sizes_mb), warmup, iters, out, backend=backend)
        return [with_environment({"op": "allreduce", **row}) for row in ast.literal_eval(Path(out).read_text())]


COLUMNS = [
    ("backend", "backend"),
    ("world", "processes"),
    ("size_mb", "MB"),
    ("median_ms", "median ms"),
    ("algbw_gbps", "algbw GB/s"),
    ("busbw_gbps", "busbw GB/s"),
]


def render(results_dir: Path, reports_dir: Path) -> str:
    """The latest run of each backend (NCCL first), each with its table and bus-bandwidth plot
    (allreduce_busbw_<backend>.png): GPU and CPU bandwidths differ by orders of magnitude."""
    records = read_records(results_dir / "allreduce.jsonl")
    if not records:
        return "No all-reduce records yet: run `fastlm bench allreduce`.\n"
    lines: list[str] = []
    for backend in sorted({r["backend"] for r in records}, key=lambda name: name != "nccl"):
        run = latest_run([r for r in records if r["backend"] == backend])
        series: dict[str, list[tuple[float, float]]] = {}
        for r in run:
            series.setdefault(f"{backend} x{r['world']}", []).append((r["size_mb"], r["busbw_gbps"]))
        first = run[0]
        plot = line_plot(
            reports_dir / f"allreduce_busbw_{backend}.png",
            [("bus bandwidth", series)],
            xlabel="tensor size (MB)",
            ylabel="busbw (GB/s)",
            title=f"All-reduce, float32, {backend} · {first['gpu']}",
            logx=True,
        )
        lines += [
            f"## {backend}",
            "",
            f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · {first['date']} · "
            f"median of {first['iters']} timed all-reduces (slowest rank each)",
            "",
            *([GLOO_NOTE, ""] if backend == "gloo" else []),
            markdown_table(run, COLUMNS),
            "",
            f"![all-reduce bus bandwidth, {backend}]({plot.name})",
            "",
        ]
    return "\n".join(lines)


@dataclass(frozen=True)
class AllreduceBenchmark(WorldSizesBenchmark):
    """Every size for every world size, each world in its own processes; rank 0 of each world prints
    the progress lines."""

    sizes_mb: tuple[float, ...]
    warmup: int = 5
    iters: int = 10

    name = "allreduce"
    title = "All-reduce benchmark"
    gloo_note = GLOO_NOTE

    def measurements(self, run: Run) -> Iterator[Measured]:
        for world in self.worlds:
            print_line(f"all-reduce, {world} processes ({self.backend}): {len(self.sizes_mb)} sizes")
            records = measure(self.backend, world, self.sizes_mb, warmup=self.warmup, iters=self.iters)
            yield Measured(f"{world} processes", records)

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        return render(results_dir, reports_dir)
