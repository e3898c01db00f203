"""`fastlm bench conv1d`: depthwise causal conv1d forward, backward and fwd+bwd per implementation.

u (B, L, D) ~ N(0, 1), weight (D, K) and bias (D,), all requiring grad, SiLU after the conv (the
Mamba-style block); the protocol and the GB/s convention are `fastlm.bench.bandwidth`'s, with the
minimum bytes of `fastlm.analysis.conv1d.Conv1dCost`. `fastlm-cuda` runs the CUDA C++ forward
(compiled on first use) with the Triton backward. Liger-Kernel has no conv1d, so no row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import fastlm
from fastlm.analysis.conv1d import Conv1dCost
from fastlm.bench.bandwidth import STAGES, Implementation, measure_stages, render_bandwidth
from fastlm.harness.records import append_records, latest_run, read_records, with_environment

RESULTS_FILE = "conv1d.jsonl"
GPU_CASES = (((1, 8192, 8192), 3, torch.float16), ((8, 4096, 2048), 4, torch.bfloat16))
CPU_CASES = (((2, 64, 32), 4, torch.float32),)  # reduced run on machines without a GPU

ConvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def conv1d_bytes(shape: tuple[int, int, int], kernel_size: int, element_size: int, stage: str) -> int:
    cost = Conv1dCost(*shape, kernel_size, element_size, bias=True, silu=True)
    return {"fwd": cost.fwd_bytes, "bwd": cost.bwd_bytes, "fwd_bwd": cost.fwd_bytes + cost.bwd_bytes}[stage]


def _eager() -> ConvFn:
    """What a PyTorch user writes: channels-first grouped conv over an explicitly padded copy."""

    def conv(u, weight, bias):
        x = F.pad(u.transpose(1, 2), (weight.shape[1] - 1, 0))
        return F.silu(F.conv1d(x, weight.unsqueeze(1), bias, groups=u.shape[-1])).transpose(1, 2)

    return conv


def _compiled() -> ConvFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(), dynamic=False)


def _fastlm(backend: str) -> Callable[[], ConvFn | str]:
    def make():
        if backend == "cuda":
            try:
                from fastlm.ops.csrc import load_causal_conv1d

                load_causal_conv1d()
            except Exception as error:  # no nvcc, or the build failed: say so in the row
                return f"unavailable: {str(error).splitlines()[0][:100]}"
        return lambda u, weight, bias: fastlm.causal_conv1d(u, weight, bias, "silu", backend=backend)

    return make


IMPLEMENTATIONS = (
    Implementation("eager", False, _eager),
    Implementation("compile", True, _compiled),
    Implementation("fastlm", False, _fastlm("triton")),
    Implementation("fastlm-cuda", True, _fastlm("cuda")),
)


def _measure_one(impl, shape, kernel_size, dtype, device, ceilings) -> dict:
    if impl.needs_gpu and device.type != "cuda":
        return {"status": "needs a GPU"}
    fn = impl.make()
    if isinstance(fn, str):
        return {"status": fn}
    u = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(shape[2], kernel_size, device=device, dtype=dtype) / kernel_size).requires_grad_()
    bias = torch.randn(shape[2], device=device, dtype=dtype, requires_grad=True)
    stage_bytes = {stage: conv1d_bytes(shape, kernel_size, u.element_size(), stage) for stage in STAGES}
    return measure_stages(fn, (u, weight, bias), torch.randn_like(u), stage_bytes, ceilings["copy_gbps"], device)


def cases(device: torch.device):
    return GPU_CASES if device.type == "cuda" else CPU_CASES


def run(device: torch.device, ceilings: dict, results_dir: Path, progress=lambda done: None) -> list[dict]:
    records = []
    for shape, kernel_size, dtype in cases(device):
        for impl in IMPLEMENTATIONS:
            record = {"op": "causal_conv1d", "shape": "x".join(map(str, shape)), "kernel_size": kernel_size,
                      "dtype": str(dtype).removeprefix("torch."), "implementation": impl.name,
                      "copy_gbps_measured": ceilings["copy_gbps"]}  # fmt: skip
            record.update(_measure_one(impl, shape, kernel_size, dtype, device, ceilings))
            records.append(with_environment(record))
            progress(f"{record['shape']} K={kernel_size} {record['dtype']} {impl.name}")
    append_records(results_dir / RESULTS_FILE, records)
    return records


def render(results_dir: Path, reports_dir: Path) -> str:
    records = latest_run(read_records(results_dir / RESULTS_FILE))
    if not records:
        return "No conv1d records yet: run `fastlm bench conv1d`.\n"
    plot = reports_dir / "conv1d_fwd_bwd_gbps.png"
    columns = [("shape", "B x L x D"), ("kernel_size", "K"), ("dtype", "dtype")]
    return render_bandwidth(records, columns, lambda r: f"{r['shape']} K={r['kernel_size']} {r['dtype']}", plot,
                            "Causal conv1d + SiLU fwd+bwd bandwidth")  # fmt: skip
