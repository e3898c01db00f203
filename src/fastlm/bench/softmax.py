"""`fastlm bench softmax`: masked softmax forward, backward and fwd+bwd for every implementation.

The attention-score case: x (B, H, Sq, Sk) ~ N(0, 1) requiring grad, scale 1/8 and an additive
key-padding mask (B, 1, 1, Sk) (the last eighth of each sequence's keys masked); the protocol and
the GB/s convention are `fastlm.bench.bandwidth`'s, with the minimum bytes of `softmax_bytes`.
Liger-Kernel has no masked softmax, so it has no row here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

import fastlm
from fastlm.bench.bandwidth import STAGES, Implementation, measure_stages, render_bandwidth
from fastlm.harness.records import append_records, latest_run, read_records, with_environment

RESULTS_FILE = "softmax.jsonl"
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


def _eager(_case=None) -> SoftmaxFn:
    return lambda x, mask: torch.softmax(x * SCALE + mask, dim=-1)


def _compiled(_case=None) -> SoftmaxFn:
    torch._dynamo.reset()  # a fresh compilation per shape and dtype
    return torch.compile(_eager(), dynamic=False)


def _fastlm(_case=None) -> SoftmaxFn:
    return lambda x, mask: fastlm.masked_softmax(x, mask, scale=SCALE)


IMPLEMENTATIONS = (
    Implementation("eager", False, _eager),
    Implementation("compile", True, _compiled),
    Implementation("fastlm", False, _fastlm),
)


def _measure_one(impl, shape, dtype, device, ceilings) -> dict:
    if impl.needs_gpu and device.type != "cuda":
        return {"status": "needs a GPU"}
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    b, _, _, sk = shape
    mask = torch.zeros(b, 1, 1, sk, device=device, dtype=dtype)
    mask[..., sk - sk // 8 :] = float("-inf")
    stage_bytes = {stage: softmax_bytes(shape, x.element_size(), stage) for stage in STAGES}
    return measure_stages(impl.make(), (x, mask), torch.randn_like(x), stage_bytes, ceilings["copy_gbps"], device)


def cases(device: torch.device) -> list[tuple[tuple[int, ...], torch.dtype]]:
    if device.type == "cuda":
        return [(s, t) for s in GPU_SHAPES for t in GPU_DTYPES]
    return [(s, torch.float32) for s in CPU_SHAPES]


def run(device: torch.device, ceilings: dict, results_dir: Path, progress=lambda done: None) -> list[dict]:
    records = []
    for shape, dtype in cases(device):
        for impl in IMPLEMENTATIONS:
            record = {"op": "masked_softmax", "shape": "x".join(map(str, shape)),
                      "dtype": str(dtype).removeprefix("torch."), "implementation": impl.name,
                      "copy_gbps_measured": ceilings["copy_gbps"]}  # fmt: skip
            record.update(_measure_one(impl, shape, dtype, device, ceilings))
            records.append(with_environment(record))
            progress(f"{record['shape']} {record['dtype']} {impl.name}")
    append_records(results_dir / RESULTS_FILE, records)
    return records


def render(results_dir: Path, reports_dir: Path) -> str:
    records = latest_run(read_records(results_dir / RESULTS_FILE))
    if not records:
        return "No softmax records yet: run `fastlm bench softmax`.\n"
    plot = reports_dir / "softmax_fwd_bwd_gbps.png"
    return render_bandwidth(records, [("shape", "B x H x Sq x Sk"), ("dtype", "dtype")],
                            lambda r: f"{r['shape']} {r['dtype']}", plot,
                            "Masked softmax (scale, key-padding mask) fwd+bwd bandwidth")  # fmt: skip
