"""A training step of a model as the measuring tools run it: what it does (`Row`), its precision
context and optimizer, the step itself and the timing of a run of steps.

`fastlm bench model`, `fastlm profile model | memory` and the profiling scripts in benchmarks/ all
step the model through these, so their numbers describe the same step.
"""

from __future__ import annotations

import contextlib
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fastlm.layers.linear import linear_weights
from fastlm.model.precision import param_groups, precision_context
from fastlm.optim import AdamW
from fastlm.settings import stores_bf16_weights

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> scalar loss


@dataclass(frozen=True)
class Row:
    """How a model is stepped: one row of `fastlm bench model`."""

    mode: str  # fwd | fwd+bwd | train (fastlm.analysis.model.MODES)
    precision: str  # fastlm.model.config.PRECISIONS (their meaning: fastlm.model.precision)
    compile: str  # fastlm.model.config.COMPILE_MODES


@contextlib.contextmanager
def weights_stored_for(model: torch.nn.Module, precision: str) -> Iterator[None]:
    """For "bf16-weights", the model's matmul weights in bf16 while the block runs, in fp32 again
    after it (rounded to bf16 values: what a measurement of speed never notices); no change for
    the other precisions."""
    weights = linear_weights(model) if stores_bf16_weights(precision) else []
    for weight in weights:
        weight.data = weight.data.to(torch.bfloat16)
    try:
        yield
    finally:
        for weight in weights:
            weight.data = weight.data.float()


def make_optimizer(model: torch.nn.Module, precision: str = "bf16") -> torch.optim.Optimizer:
    """AdamW for every model measured here. fp32 weights: PyTorch's fused single-kernel
    implementation on CUDA, so the optimizer costs the same for every model and as little as
    PyTorch allows. "bf16-weights" (inside `weights_stored_for`): fastlm's AdamW, one launch per
    group, with fp32 masters of the bf16 matmul weights. The groups are training's
    (`fastlm.model.precision.param_groups`)."""
    groups = param_groups(model, precision, weight_decay=0.1)
    if stores_bf16_weights(precision):
        return AdamW(groups, lr=1e-4)
    return torch.optim.AdamW(groups, lr=1e-4, fused=next(model.parameters()).is_cuda)


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
