"""Cost model of fused cross-entropy: bytes, FLOPs, intensity, bound, minimum time.

The configuration modelled here: logits bf16 (2 B), targets int64 (8 B), losses fp32 (4 B),
the saved logsumexp fp32 (4 B), upstream gradient fp32 (4 B), dlogits bf16 (2 B),
reduction='none'; B rows, V classes.

Forward (one pass, writes loss and lse):
    loaded = 2BV + 8B            stored = 4B + 4B
Backward (recomputes softmax from logits and the saved lse):
    loaded = 2BV + 8B + 4B + 4B  stored = 2BV
Fused training pass (loss and dlogits in one kernel, minimum if the second read of each row
hits L2):
    loaded = 2BV + 8B            stored = 2BV + 4B

FLOPs per token, counting add, sub, mul, div, exp, log as 1 and max as 0:
    forward  3V + 3: per class x - m, exp, + to the sum; then log s, + m, lse - x_t
    backward 3V + 1: per class x - lse, exp, * upstream; then - 1 at the target
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from fastlm.analysis.roofline import Bound, elementwise_bound
from fastlm.analysis.tables import add_columns
from fastlm.devices import DeviceSpec
from fastlm.utils.tables import si, si_seconds

LOGIT_BYTES, TARGET_BYTES, LOSS_BYTES, LSE_BYTES, GRAD_OUTPUT_BYTES, GRAD_BYTES = 2, 8, 4, 4, 4, 2


@dataclass(frozen=True)
class CrossEntropyCost:
    batch: int
    vocab: int

    @property
    def fwd_bytes_loaded(self) -> int:
        return LOGIT_BYTES * self.batch * self.vocab + TARGET_BYTES * self.batch

    @property
    def fwd_bytes_stored(self) -> int:
        return (LOSS_BYTES + LSE_BYTES) * self.batch

    @property
    def bwd_bytes_loaded(self) -> int:
        return LOGIT_BYTES * self.batch * self.vocab + (TARGET_BYTES + LSE_BYTES + GRAD_OUTPUT_BYTES) * self.batch

    @property
    def bwd_bytes_stored(self) -> int:
        return GRAD_BYTES * self.batch * self.vocab

    @property
    def fused_bytes(self) -> int:
        """Loaded + stored by the single-pass training kernel."""
        return (LOGIT_BYTES + GRAD_BYTES) * self.batch * self.vocab + (TARGET_BYTES + LOSS_BYTES) * self.batch

    @property
    def fwd_bytes(self) -> int:
        return self.fwd_bytes_loaded + self.fwd_bytes_stored

    @property
    def bwd_bytes(self) -> int:
        return self.bwd_bytes_loaded + self.bwd_bytes_stored

    @property
    def fwd_flops_per_token(self) -> int:
        return 3 * self.vocab + 3

    @property
    def bwd_flops_per_token(self) -> int:
        return 3 * self.vocab + 1

    @property
    def fwd_flops(self) -> int:
        return self.fwd_flops_per_token * self.batch

    @property
    def bwd_flops(self) -> int:
        return self.bwd_flops_per_token * self.batch

    def fwd_bound(self, spec: DeviceSpec) -> Bound:
        return elementwise_bound(self.fwd_flops, self.fwd_bytes, spec)

    def bwd_bound(self, spec: DeviceSpec) -> Bound:
        return elementwise_bound(self.bwd_flops, self.bwd_bytes, spec)

    def fused_bound(self, spec: DeviceSpec) -> Bound:
        return elementwise_bound(self.fwd_flops + self.bwd_flops, self.fused_bytes, spec)


FORMULAS = {
    "fwd loaded": "2BV + 8B",
    "fwd stored": "4B + 4B",
    "bwd loaded": "2BV + 16B",
    "bwd stored": "2BV",
    "fwd FLOPs/token": "3V + 3",
    "bwd FLOPs/token": "3V + 1",
}


def cost_tables(cost: CrossEntropyCost, spec: DeviceSpec) -> list[Table | str]:
    """What `fastlm analyze xent` prints, in order: the forward and backward table on ``spec``, then
    a sentence (rich markup) on the fused training pass."""
    fwd, bwd = cost.fwd_bound(spec), cost.bwd_bound(spec)
    table = Table(title=f"Cross-entropy cost model · B={cost.batch}, V={cost.vocab} · {spec.name}")
    add_columns(table, ("quantity", "formula"), ("forward", "backward"))
    table.add_row(
        "bytes loaded",
        f"{FORMULAS['fwd loaded']} | {FORMULAS['bwd loaded']}",
        si(cost.fwd_bytes_loaded, "B"),
        si(cost.bwd_bytes_loaded, "B"),
    )
    table.add_row(
        "bytes stored",
        f"{FORMULAS['fwd stored']} | {FORMULAS['bwd stored']}",
        si(cost.fwd_bytes_stored, "B"),
        si(cost.bwd_bytes_stored, "B"),
    )
    table.add_row(
        "FLOPs per token",
        f"{FORMULAS['fwd FLOPs/token']} | {FORMULAS['bwd FLOPs/token']}",
        si(cost.fwd_flops_per_token),
        si(cost.bwd_flops_per_token),
    )
    table.add_row("FLOPs", "B x per token", si(cost.fwd_flops), si(cost.bwd_flops))
    table.add_row("arithmetic intensity", "FLOPs / bytes", f"{fwd.intensity:.3g} FLOP/B", f"{bwd.intensity:.3g} FLOP/B")
    table.add_row(
        "device ridge (CUDA cores fp32)",
        f"{spec.vector_fp32_tflops:g} TF / {spec.memory_gbps:g} GB/s",
        f"{fwd.ridge:.3g} FLOP/B",
        f"{bwd.ridge:.3g} FLOP/B",
    )
    tensor_rate = f"{spec.matmul_tflops:g} TF {spec.matmul_dtype} / {spec.memory_gbps:g} GB/s"
    table.add_row(
        "device ridge (tensor cores)",
        tensor_rate,
        f"{spec.ridge_flops_per_byte:.3g} FLOP/B",
        f"{spec.ridge_flops_per_byte:.3g} FLOP/B",
    )
    table.add_row("verdict", "intensity vs ridge", fwd.verdict, bwd.verdict)
    table.add_row("minimum time", "max(bytes/BW, FLOPs/rate)", si_seconds(fwd.min_time_s), si_seconds(bwd.min_time_s))
    fused = cost.fused_bound(spec)
    return [
        table,
        f"Fused training pass (loss + dlogits in one kernel): {si(cost.fused_bytes, 'B')}, "
        f"minimum {si_seconds(fused.min_time_s)} vs {si_seconds(fwd.min_time_s + bwd.min_time_s)} "
        "for forward + backward.",
    ]
