"""Cost model of the depthwise causal conv1d: bytes, FLOPs, intensity, bound, minimum time.

u (B, L, D) and out (B, L, D) of element size s, weight (D, K), bias (D,). FLOPs per output,
counting add, mul, exp, div as 1: 2K for the taps (a multiply and an add each), 1 for the bias,
4 for SiLU (exp, add, div... z / (1 + exp(-z)) counted as exp, add, div plus the negation).

Forward bytes, fused (the zero padding is a load mask):
    read u once, write out once      2 B L D s + (K + 1) D s
With a separate padding pass (pad u to (B, L + K - 1, D), then convolve the padded copy):
    pad:  read B L D s, write B (L + K - 1) D s
    conv: read B (L + K - 1) D s, write B L D s                     (+ the weight and bias)
which is about twice the fused traffic. Backward (fused, z recomputed): read u and dout, write du
(3 B L D s) plus the weight read and its (and the bias's) gradient written.

The taps are few (K <= 8) and the math runs on the CUDA cores, so the intensity is about
(2K + 5) / (2 s) FLOP/B, far below any GPU's ridge: the conv is memory-bound and its time floor
is bytes / bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from fastlm.analysis.roofline import Bound, elementwise_bound
from fastlm.analysis.tables import add_columns
from fastlm.devices import DeviceSpec
from fastlm.utils.tables import si, si_seconds

SILU_FLOPS = 4


@dataclass(frozen=True)
class Conv1dCost:
    batch: int
    length: int
    channels: int
    kernel_size: int
    element_size: int = 2
    bias: bool = True
    silu: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "length", "channels", "kernel_size", "element_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def outputs(self) -> int:
        return self.batch * self.length * self.channels

    @property
    def flops_per_output(self) -> int:
        return 2 * self.kernel_size + int(self.bias) + (SILU_FLOPS if self.silu else 0)

    @property
    def fwd_flops(self) -> int:
        return self.outputs * self.flops_per_output

    @property
    def param_bytes(self) -> int:
        return (self.kernel_size + int(self.bias)) * self.channels * self.element_size

    @property
    def fwd_bytes(self) -> int:
        """Fused: u read once, out written once, the weight and bias read."""
        return 2 * self.outputs * self.element_size + self.param_bytes

    @property
    def padding_pass_bytes(self) -> int:
        """A separate pass writes the padded copy that the conv then reads."""
        padded = self.batch * (self.length + self.kernel_size - 1) * self.channels * self.element_size
        return self.outputs * self.element_size + 2 * padded + self.outputs * self.element_size + self.param_bytes

    @property
    def bwd_bytes(self) -> int:
        """u and dout read, du written; the weight read, its gradient (and the bias's) written."""
        return (
            3 * self.outputs * self.element_size
            + self.param_bytes
            + self.kernel_size * self.channels * self.element_size
        )

    def fwd_bound(self, spec: DeviceSpec, padding_pass: bool = False) -> Bound:
        return elementwise_bound(self.fwd_flops, self.padding_pass_bytes if padding_pass else self.fwd_bytes, spec)


FORMULAS = {
    "fused": "2 B L D s + (K + 1) D s",
    "padding pass": "B L D s + 2 B (L + K - 1) D s + B L D s + (K + 1) D s",
    "FLOPs": "B L D (2K + bias + 4 silu)",
}


def cost_tables(cost: Conv1dCost, dtype: str, spec: DeviceSpec) -> list[Table | str]:
    """What `fastlm analyze conv1d` prints, in order: the forward table on ``spec``, fused vs a
    separate padding pass, then a sentence on the backward; ``dtype`` names the element type."""
    fused, padded = cost.fwd_bound(spec), cost.fwd_bound(spec, padding_pass=True)
    table = Table(
        title=f"Causal conv1d forward · B={cost.batch}, L={cost.length}, D={cost.channels}, "
        f"K={cost.kernel_size}, {dtype} · {spec.name}"
    )
    add_columns(table, ("quantity", "formula"), ("fused (masked loads)", "separate padding pass"))
    table.add_row(
        "bytes", f"{FORMULAS['fused']} | {FORMULAS['padding pass']}", si(fused.bytes, "B"), si(padded.bytes, "B")
    )
    table.add_row("FLOPs", FORMULAS["FLOPs"], si(fused.flops), si(padded.flops))
    table.add_row(
        "arithmetic intensity", "FLOPs / bytes", f"{fused.intensity:.3g} FLOP/B", f"{padded.intensity:.3g} FLOP/B"
    )
    ridge = f"{spec.vector_fp32_tflops:g} TF / {spec.memory_gbps:g} GB/s"
    table.add_row("device ridge (CUDA cores fp32)", ridge, f"{fused.ridge:.3g} FLOP/B", f"{padded.ridge:.3g} FLOP/B")
    table.add_row("verdict", "intensity vs ridge", fused.verdict, padded.verdict)
    table.add_row(
        "minimum time", "max(bytes/BW, FLOPs/rate)", si_seconds(fused.min_time_s), si_seconds(padded.min_time_s)
    )
    return [
        table,
        f"Backward (fused, z recomputed): {si(cost.bwd_bytes, 'B')}, at least "
        f"{si_seconds(cost.bwd_bytes / (spec.memory_gbps * 1e9))}. The conv sits far left of the ridge on the "
        "roofline: its floor is bytes / bandwidth, so the fused kernel's target is the copy bandwidth.",
    ]
