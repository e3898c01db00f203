"""Kernel summaries from a torch.profiler run, like Nsight Systems' "CUDA GPU Kernel Summary", split
by the named ranges of `fastlm.layers.ranges` (forward, backward, optimizer, attention/...).

Attribution: a GPU kernel belongs to the innermost named range whose CPU interval contains the
moment its launch was issued. Backward kernels are launched from autograd's own thread while the
main thread sits inside the "backward" range, so time (not the parent chain) is what links them.
Without a GPU the same summary is built from the CPU time of the aten operators (self time, so
nothing is counted twice).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch.autograd import DeviceType

OUTSIDE = "(no range)"
# Substrings that mark matrix-multiply kernels: cuBLAS (gemm, xmma, nvjet), CUTLASS, Inductor's
# mm templates (triton_tem_), and the aten matmul operators on CPU.
MATMUL_MARKERS = (
    "gemm",
    "xmma",
    "nvjet",
    "cutlass",
    "triton_tem_",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::linear",
    "aten::matmul",
    "aten::baddbmm",
)
# Fused attention kernels (matmuls and softmax in one): fastlm's, SDPA's flash / cuDNN / efficient.
ATTENTION_MARKERS = ("flash", "fmha", "attention", "cudnn_generated", "_efficient_")


def kernel_category(name: str) -> str:
    """'attention' (fused), 'matmul' or 'other', from the kernel's (or CPU op's) name."""
    lowered = name.lower()
    if any(marker in lowered for marker in ATTENTION_MARKERS):
        return "attention"
    if any(marker in lowered for marker in MATMUL_MARKERS):
        return "matmul"
    return "other"


@dataclass
class KernelStats:
    name: str
    calls: int = 0
    total_us: float = 0.0

    @property
    def average_us(self) -> float:
        return self.total_us / self.calls


def _range_intervals(events, range_names: set[str]) -> list[tuple[float, float, str]]:
    return [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in range_names]


def _innermost(intervals: list[tuple[float, float, str]], t: float) -> str:
    containing = [(end - start, name) for start, end, name in intervals if start <= t <= end]
    return min(containing)[1] if containing else OUTSIDE


def summarize_kernels(events, range_names: set[str]) -> tuple[dict[str, dict[str, KernelStats]], bool]:
    """{range: {kernel name: stats}} from ``profiler.events()``, and whether these are GPU kernels
    (True) or, without any GPU kernel in the profile, CPU operators (False)."""
    intervals = _range_intervals(events, range_names)
    summary: dict[str, dict[str, KernelStats]] = defaultdict(dict)

    def add(range_name: str, name: str, duration_us: float) -> None:
        stats = summary[range_name].setdefault(name, KernelStats(name))
        stats.calls += 1
        stats.total_us += duration_us

    on_gpu = False
    for event in events:
        for kernel in getattr(event, "kernels", ()):
            on_gpu = True
            add(_innermost(intervals, event.time_range.start), kernel.name, kernel.duration)
    if not on_gpu:
        for event in events:
            if (
                event.device_type == DeviceType.CPU
                and event.name.startswith("aten::")
                and event.self_cpu_time_total > 0
            ):
                add(_innermost(intervals, event.time_range.start), event.name, event.self_cpu_time_total)
    return dict(summary), on_gpu


def category_shares(kernels: dict[str, KernelStats]) -> dict[str, float]:
    """Fraction of the time in ``kernels`` spent in each category (matmul, attention, other)."""
    totals: dict[str, float] = defaultdict(float)
    for stats in kernels.values():
        totals[kernel_category(stats.name)] += stats.total_us
    whole = sum(totals.values()) or 1.0
    return {category: totals.get(category, 0.0) / whole for category in ("matmul", "attention", "other")}


def merge(*summaries: dict[str, KernelStats]) -> dict[str, KernelStats]:
    """Kernels of several ranges pooled by name."""
    pooled: dict[str, KernelStats] = {}
    for kernels in summaries:
        for name, stats in kernels.items():
            total = pooled.setdefault(name, KernelStats(name))
            total.calls += stats.calls
            total.total_us += stats.total_us
    return pooled
