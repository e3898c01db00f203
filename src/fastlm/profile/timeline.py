"""Where a GPU's time goes over profiled steps, from the kernels' intervals alone: busy computing,
communicating (NCCL kernels), communicating with nothing else to run (exposed), or idle.

A data-parallel step scales when its collectives hide under compute: the exposed time is what the
wire adds to a step, the idle time what the host (or a slower rank, whose collectives the others
wait for inside NCCL kernels, counted as communication) leaves unfilled. Times in the profiler's
microseconds in, milliseconds per step out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch.autograd import DeviceType

COMMUNICATION_MARKER = "nccl"  # NCCL's kernels: ncclDevKernel_AllReduce_..., ncclKernel_...


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


@dataclass(frozen=True)
class GpuTimeline:
    """Milliseconds per step between the first kernel's start and the last one's end."""

    span_ms: float
    compute_ms: float  # some kernel other than communication runs (copies and memsets included)
    communication_ms: float  # some communication kernel runs
    exposed_communication_ms: float  # communication runs and nothing else does
    idle_ms: float  # no kernel runs

    def as_dict(self) -> dict:
        return asdict(self)


def gpu_timeline(kernels: list[tuple[str, float, float]], steps: int) -> GpuTimeline:
    """From (name, start_us, end_us) of every kernel over ``steps`` steps."""
    if not kernels:
        raise ValueError("no GPU kernels in the profile: nothing ran on a GPU while it was traced")
    compute = [(s, e) for name, s, e in kernels if COMMUNICATION_MARKER not in name.lower()]
    communication = [(s, e) for name, s, e in kernels if COMMUNICATION_MARKER in name.lower()]
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = covered([(s, e) for _, s, e in kernels])
    compute_busy = covered(compute)

    def per_step(us: float) -> float:
        return us / 1e3 / steps

    return GpuTimeline(
        span_ms=per_step(span),
        compute_ms=per_step(compute_busy),
        communication_ms=per_step(covered(communication)),
        exposed_communication_ms=per_step(busy - compute_busy),
        idle_ms=per_step(span - busy),
    )


def profiled_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the GPU kernels of a finished `torch.profiler.profile`."""
    return [
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation  # ranges, not kernels
    ]
