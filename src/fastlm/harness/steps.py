"""A training step of a model as the measuring tools run it: what it does (`Row`), its precision
context and optimizer, the step itself and the timing of a run of steps.

`fastlm bench model`, `fastlm profile model | memory` and the profiling scripts in benchmarks/ all
step the model through these, so their numbers describe the same step.
"""

from __future__ import annotations

import contextlib
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> scalar loss


@dataclass(frozen=True)
class Row:
    """How a model is stepped: one row of `fastlm bench model`."""

    mode: str  # fwd | fwd+bwd | train (fastlm.analysis.model.MODES)
    precision: str  # fp32 | bf16 (autocast)
    compile: str  # fastlm.model.config.COMPILE_MODES


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW for every model measured here: the fused single-kernel implementation on CUDA, so the
    optimizer costs the same for every model and as little as PyTorch allows."""
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda)


def make_step(
    loss_fn: LossFn,
    model: torch.nn.Module,
    row: Row,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
) -> Callable[[], None]:
    device = tokens.device

    def forward() -> torch.Tensor:
        with precision_context(row.precision, device):
            return loss_fn(tokens, targets)

    def step() -> None:
        if row.compile == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
        if row.mode == "fwd":
            forward()
            return
        model.zero_grad(set_to_none=True)
        forward().backward()
        if row.mode == "train":
            optimizer.step()

    return step


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of the warmup + steps calls, synchronized before the clock stops."""
    times = []
    for _ in range(warmup + steps):
        start = timeit.default_timer()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((timeit.default_timer() - start) * 1e3)
    return times
