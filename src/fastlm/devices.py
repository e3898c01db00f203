"""Datasheet numbers of the GPUs fastlm reports against, and lookup of the current device.

Datasheet rates are the ceiling a vendor quotes; `fastlm bench ceilings` measures what a copy and
a matrix product actually reach on the card at hand, and benchmarks report both fractions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    key: str  # short name used on the command line
    name: str
    memory_gbps: float  # DRAM bandwidth, GB/s (1e9 bytes/s)
    matmul_tflops: float  # dense tensor-core rate, TFLOP/s (bf16; fp16 where bf16 is absent)
    matmul_dtype: str
    vector_fp32_tflops: float  # non-tensor-core fp32 rate (elementwise math runs here)

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which tensor-core work is compute-bound."""
        return self.matmul_tflops * 1e12 / (self.memory_gbps * 1e9)

    @property
    def vector_ridge_flops_per_byte(self) -> float:
        """The same ridge for fp32 elementwise math on the CUDA cores."""
        return self.vector_fp32_tflops * 1e12 / (self.memory_gbps * 1e9)


DEVICES = {
    "a100": DeviceSpec("a100", "A100 SXM", 2039.0, 312.0, "bf16", 19.5),
    "h100": DeviceSpec("h100", "H100 SXM", 3350.0, 989.0, "bf16", 67.0),
    "h200": DeviceSpec("h200", "H200", 4800.0, 989.0, "bf16", 67.0),
    "t4": DeviceSpec("t4", "T4", 300.0, 65.0, "fp16", 8.1),
}


def device_spec(key: str) -> DeviceSpec:
    """The spec for ``key`` (a100, h100, h200, t4); ValueError listing the known keys otherwise."""
    try:
        return DEVICES[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(DEVICES)}") from None


def current_device():
    """The ``torch.device`` commands run on: the first CUDA GPU if there is one, else the CPU."""
    import torch  # here, not at the top: the device table serves the command line's fast paths

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def current_device_name() -> str:
    """'NVIDIA H100 80GB HBM3' on a GPU machine, 'cpu' otherwise."""
    import torch  # here, not at the top: the device table serves the command line's fast paths

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def spec_for_device_name(name: str) -> DeviceSpec | None:
    """Match a CUDA device name to the table ('NVIDIA H100 80GB HBM3' -> h100); None if unknown."""
    padded = f" {name.lower()}"
    return next((spec for key, spec in DEVICES.items() if f" {key}" in padded), None)
