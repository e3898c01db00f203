"""Option values of `fastlm bench ddp`, without torch: the command line builds its parser and checks
a value with them before torch is imported (seconds); `fastlm.bench.distributed.ddp` uses them too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fastlm.settings import PARALLEL_MODES, ParallelSpec

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


BF16_SUFFIX = "-bf16"  # a variant's name with it: the same wrapper averaging the gradients in bf16


def ddp_variant(name: str) -> Variant:
    """The variant called ``name``: one of DDP_VARIANTS, or bucketed-X for any finite X MB > 0 (no-sync
    is the wrapper `none`: the compute-only step), any of them but no-sync with -bf16 appended (the
    gradients averaged in bf16); ValueError otherwise."""
    base_name = name.removesuffix(BF16_SUFFIX)
    variant = _plain_variant(base_name)
    if variant is not None and base_name == name:
        return variant
    if variant is not None and variant.spec.parallelism.processes:
        return Variant(name, dataclasses.replace(variant.spec, reduce_dtype="bf16"))
    raise ValueError(
        f"unknown variant {name!r}; known: {', '.join(DDP_VARIANTS)} (bucketed-X for any finite X MB > 0; "
        f"any but no-sync with {BF16_SUFFIX} to average in bf16)"
    )


def _plain_variant(name: str) -> Variant | None:
    """A variant without the bf16 suffix, or None for a name that is none."""
    if name == "no-sync":
        return Variant(name, ParallelSpec("none"))
    if name in DDP_VARIANTS and name in PARALLEL_MODES:  # a variant named as its mode
        return Variant(name, ParallelSpec(name))
    if name.startswith("bucketed-"):
        try:
            bucket_mb = float(name.removeprefix("bucketed-"))
        except ValueError:
            bucket_mb = math.nan
        if 0 < bucket_mb < math.inf:
            return Variant(name, ParallelSpec("bucketed", bucket_mb))
    return None
