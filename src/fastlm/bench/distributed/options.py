"""Option values of `fastlm bench ddp`, without torch: the command line builds its parser and checks
a value with them before torch is imported (seconds); `fastlm.bench.distributed.ddp` uses them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastlm.distributed.wrappers import ParallelSpec

DDP_VARIANTS = (
    "no-sync",
    "naive",
    "flat",
    "ddp",
    "bucketed-1",
    "bucketed-10",
    "bucketed-100",
    "bucketed-1000",
    "torch-ddp",
)
DDP_OPTIMIZERS = ("adamw", "sharded", "zero")


@dataclass(frozen=True)
class Variant:
    """A gradient synchronization the benchmark measures: its name in records and reports, its wrapper."""

    name: str
    spec: ParallelSpec


def ddp_variant(name: str) -> Variant:
    """The variant called ``name``: one of DDP_VARIANTS, or bucketed-X for any finite X MB > 0 (no-sync
    is the wrapper `none`: the compute-only step); ValueError otherwise."""
    if name == "no-sync":
        return Variant(name, ParallelSpec("none"))
    if name in ("naive", "flat", "ddp", "torch-ddp"):
        return Variant(name, ParallelSpec(name))
    if name.startswith("bucketed-"):
        try:
            bucket_mb = float(name.removeprefix("bucketed-"))
        except ValueError:
            bucket_mb = math.nan
        if 0 < bucket_mb < math.inf:
            return Variant(name, ParallelSpec("bucketed", bucket_mb))
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(DDP_VARIANTS)} (bucketed-X for any finite X MB > 0)")
