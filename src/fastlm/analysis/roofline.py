"""The roofline verdict shared by every cost model: which ceiling binds, and the time floor."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.devices import DeviceSpec


@dataclass(frozen=True)
class Bound:
    flops: float
    bytes: float
    compute_rate: float  # FLOP/s of the unit that does this math
    bandwidth: float  # bytes/s

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved through DRAM."""
        return self.flops / self.bytes

    @property
    def ridge(self) -> float:
        """Intensity at which compute time equals memory time on this device."""
        return self.compute_rate / self.bandwidth

    @property
    def verdict(self) -> str:
        return "memory-bound" if self.intensity < self.ridge else "compute-bound"

    @property
    def min_time_s(self) -> float:
        """No implementation can be faster than the slower of its two floors."""
        return max(self.flops / self.compute_rate, self.bytes / self.bandwidth)


def elementwise_bound(flops: float, bytes_moved: float, spec: DeviceSpec) -> Bound:
    """Bound for math done on the CUDA cores (fp32 vector rate), not the tensor cores."""
    return Bound(flops, bytes_moved, spec.vector_fp32_tflops * 1e12, spec.memory_gbps * 1e9)
