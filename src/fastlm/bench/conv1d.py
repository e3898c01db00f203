"""`fastlm bench conv1d`: depthwise causal conv1d forward, backward and fwd+bwd per implementation.

u (B, L, D) ~ N(0, 1), weight (D, K) and bias (D,), all requiring grad, SiLU after the conv (the
Mamba-style block); the protocol and the GB/s convention are `fastlm.bench.bandwidth`'s, with the
minimum bytes of `fastlm.analysis.conv1d.Conv1dCost`. `fastlm-cuda` runs the CUDA C++ forward
(compiled on first use) with the Triton backward. Liger-Kernel has no conv1d, so no row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastlm
from fastlm.analysis.conv1d import Conv1dCost
from fastlm.bench.bandwidth import STAGES, BandwidthBenchmark, measure_stages
from fastlm.harness.benchmark import Implementation, Run

GPU_CASES = (((1, 8192, 8192), 3, torch.float16), ((8, 4096, 2048), 4, torch.bfloat16))
CPU_CASES = (((2, 64, 32), 4, torch.float32),)  # reduced run on machines without a GPU

ConvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def conv1d_bytes(shape: tuple[int, int, int], kernel_size: int, element_size: int, stage: str) -> int:
    cost = Conv1dCost(*shape, kernel_size, element_size, bias=True, silu=True)
    return {"fwd": cost.fwd_bytes, "bwd": cost.bwd_bytes, "fwd_bwd": cost.fwd_bytes + cost.bwd_bytes}[stage]


@dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int]  # (B, L, D)
    kernel_size: int
    dtype: torch.dtype


def _eager(_case=None) -> ConvFn:
    """What a PyTorch user writes: channels-first grouped conv over an explicitly padded copy."""

    def conv(u, weight, bias):
        x = F.pad(u.transpose(1, 2), (weight.shape[1] - 1, 0))
        return F.silu(F.conv1d(x, weight.unsqueeze(1), bias, groups=u.shape[-1])).transpose(1, 2)

    return conv


def _compiled(_case: Case) -> ConvFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(), dynamic=False)


def _fastlm(backend: str) -> Callable[[Case], ConvFn | str]:
    def make(_case: Case) -> ConvFn | str:
        if backend == "cuda":
            try:
                from fastlm.ops.csrc import load_causal_conv1d

                load_causal_conv1d()
            except Exception as error:  # no nvcc, or the build failed: say so in the row
                return f"unavailable: {str(error).splitlines()[0][:100]}"
        return lambda u, weight, bias: fastlm.causal_conv1d(u, weight, bias, "silu", backend=backend)

    return make


IMPLEMENTATIONS = (
    Implementation("eager", _eager),
    Implementation("compile", _compiled, needs_gpu=True),
    Implementation("fastlm", _fastlm("triton")),
    Implementation("fastlm-cuda", _fastlm("cuda"), needs_gpu=True),
)


class Conv1dBenchmark(BandwidthBenchmark):
    name = "conv1d"
    title = "Causal conv1d benchmark"
    progress_name = "conv1d"
    case_columns = (("shape", "B x L x D"), ("kernel_size", "K"), ("dtype", "dtype"))
    plot_title = "Causal conv1d + SiLU fwd+bwd bandwidth"
    empty_report = "No conv1d records yet: run `fastlm bench conv1d`.\n"

    def cases(self, device: torch.device) -> list[Case]:
        return [Case(*case) for case in (GPU_CASES if device.type == "cuda" else CPU_CASES)]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def case_fields(self, case: Case) -> dict:
        return {
            "op": "causal_conv1d",
            "shape": "x".join(map(str, case.shape)),
            "kernel_size": case.kernel_size,
            "dtype": str(case.dtype).removeprefix("torch."),
        }

    def case_label(self, record: dict) -> str:
        return f"{record['shape']} K={record['kernel_size']} {record['dtype']}"

    def measure(self, case: Case, fn: ConvFn, run: Run) -> dict:
        width, taps = case.shape[2], case.kernel_size
        u = torch.randn(case.shape, device=run.device, dtype=case.dtype, requires_grad=True)
        weight = (torch.randn(width, taps, device=run.device, dtype=case.dtype) / taps).requires_grad_()
        bias = torch.randn(width, device=run.device, dtype=case.dtype, requires_grad=True)
        stage_bytes = {stage: conv1d_bytes(case.shape, taps, u.element_size(), stage) for stage in STAGES}
        copy_gbps = run.ceilings["copy_gbps"]
        return measure_stages(fn, (u, weight, bias), torch.randn_like(u), stage_bytes, copy_gbps, run.device)
