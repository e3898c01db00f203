"""The GPU timeline of profiled data-parallel steps: communication and compute kernels as intervals,
their unions and overlap, and the backward windows that communication can hide behind.

On each rank's GPU timeline every NCCL kernel is communication and every other kernel (and copy)
compute; a kernel's phase (one of PHASES) is the named range in which its launch was issued. An
NCCL kernel that starts before its peers spins until the last one arrives, so a collective's
communication runs from the latest start over the ranks to its end on rank 0
(`collective_intervals`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.autograd import DeviceType

PHASES = ("forward", "backward", "sync", "optimizer")  # the named ranges of a training step

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
        return {
            "comm_ms": total / steps,
            "hidden_behind_backward": hidden / total,
            "exposed_comm_ms": (total - hidden) / steps,
        }

    def usage(self, steps: int) -> dict:
        """ms per step between the first kernel's start and the last one's end (span): some compute
        kernel runs (compute), some NCCL kernel (comm), only NCCL kernels (exposed_comm: what the
        wire adds to the step), none (idle: what the host, or a rank the collectives wait for,
        leaves unfilled); overlap is the share of comm hidden under compute (None without comm).
        Unlike `summary`, which counts comm hidden behind backward windows, any compute hides it."""
        compute = [iv for intervals in self.compute.values() for iv in intervals]
        everything = compute + self.comm
        if not everything:
            raise ValueError("no GPU kernels in the profile: nothing ran on a GPU while it was traced")
        span = max(end for _, end in everything) - min(start for start, _ in everything)
        busy, compute_busy, comm = length(everything), length(compute), length(self.comm)
        return {
            "span_ms": span / steps,
            "compute_ms": compute_busy / steps,
            "comm_ms": comm / steps,
            "exposed_comm_ms": (busy - compute_busy) / steps,
            "idle_ms": (span - busy) / steps,
            "overlap": 1 - (busy - compute_busy) / comm if comm else None,
        }

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
