"""Benchmarks measured once per world size, each in processes of their own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fastlm.harness.benchmark import Benchmark


@dataclass(frozen=True)
class WorldSizesBenchmark(Benchmark):
    """A benchmark measured once per world size, each in processes of its own (`spawn`); its rank 0
    prints the progress lines, as a bar redrawn by this process would garble them."""

    backend: str  # gloo | nccl
    worlds: tuple[int, ...]

    gloo_note: ClassVar[str]  # what a gloo run (CPU processes, no NCCL) does not measure, said before it starts

    def note(self, device: torch.device) -> str | None:
        return self.gloo_note if self.backend == "gloo" else None

    def cases(self, device: torch.device) -> tuple[int, ...]:
        return self.worlds

    def count(self, device: torch.device) -> int:
        return len(self.worlds)
