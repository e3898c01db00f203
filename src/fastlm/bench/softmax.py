"""`fastlm bench softmax`: masked softmax forward, backward and fwd+bwd for every implementation.

The attention-score case: x (B, H, Sq, Sk) ~ N(0, 1) requiring grad, scale 1/8 and an additive
key-padding mask (B, 1, 1, Sk) (the last eighth of each sequence's keys masked); the protocol and
the GB/s convention are `fastlm.bench.bandwidth`'s, with the minimum bytes of `softmax_bytes`.
Liger-Kernel has no masked softmax, so it has no row here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fastlm
from fastlm.bench.bandwidth import STAGES, BandwidthBenchmark, measure_stages
from fastlm.harness.benchmark import Implementation, Run

SCALE = 0.125
# The last two: long rows, 256 of them (32 MB in bf16, smaller than an H100's L2: the launch and a
# grid of 2 programs per SM weigh) and 2048 of them (256 MB, a large shape)
GPU_SHAPES = ((8, 16, 1024, 1024), (2, 16, 4096, 4096), (1, 4, 64, 65536), (1, 16, 128, 65536))
GPU_DTYPES = (torch.bfloat16, torch.float32)
CPU_SHAPES = ((1, 2, 32, 64),)  # reduced run on machines without a GPU

SoftmaxFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def softmax_bytes(shape: tuple[int, ...], element_size: int, stage: str) -> int:
    """Minimum bytes: the forward reads x and the (B, 1, 1, Sk) mask and writes y; the backward
    reads y and dy and writes dx."""
    b, _, _, sk = shape
    elements = math.prod(shape)
    forward = 2 * elements * element_size + b * sk * element_size
    backward = 3 * elements * element_size
    return {"fwd": forward, "bwd": backward, "fwd_bwd": forward + backward}[stage]


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int, int]  # (B, H, Sq, Sk)
    dtype: torch.dtype


def _eager(_case=None) -> SoftmaxFn:
    return lambda x, mask: torch.softmax(x * SCALE + mask, dim=-1)


def _compiled(_case: Case) -> SoftmaxFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(), dynamic=False)


def _fastlm(_case: Case) -> SoftmaxFn:
    return lambda x, mask: fastlm.masked_softmax(x, mask, scale=SCALE)


IMPLEMENTATIONS = (
    Implementation("eager", _eager),
    Implementation("compile", _compiled, needs_gpu=True),
    Implementation("fastlm", _fastlm),
)


class SoftmaxBenchmark(BandwidthBenchmark):
    name = "softmax"
    title = "Masked softmax benchmark"
    progress_name = "softmax"
    case_columns = (("shape", "B x H x Sq x Sk"), ("dtype", "dtype"))
    plot_title = "Masked softmax (scale, key-padding mask) fwd+bwd bandwidth"
    empty_report = "No softmax records yet: run `fastlm bench softmax`.\n"

    def cases(self, device: torch.device) -> list[Case]:
        if device.type == "cuda":
            return [Case(s, t) for s in GPU_SHAPES for t in GPU_DTYPES]
        return [Case(s, torch.float32) for s in CPU_SHAPES]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def case_fields(self, case: Case) -> dict:
        return {
            "op": "masked_softmax",
            "shape": "x".join(map(str, case.shape)),
            "dtype": str(case.dtype).removeprefix("torch."),
        }

    def case_label(self, record: dict) -> str:
        return f"{record['shape']} {record['dtype']}"

    def measure(self, case: Case, fn: SoftmaxFn, run: Run) -> dict:
        x = torch.randn(case.shape, device=run.device, dtype=case.dtype, requires_grad=True)
        b, _, _, sk = case.shape
        mask = torch.zeros(b, 1, 1, sk, device=run.device, dtype=case.dtype)
        mask[..., sk - sk // 8 :] = float("-inf")
        stage_bytes = {stage: softmax_bytes(case.shape, x.element_size(), stage) for stage in STAGES}
        return measure_stages(fn, (x, mask), torch.randn_like(x), stage_bytes, run.ceilings["copy_gbps"], run.device)
