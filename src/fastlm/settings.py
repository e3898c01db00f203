"""The vocabularies every part of fastlm speaks, without torch (the command line builds its parsers
from these before anything imports torch):

    Kernels      which kernel each layer runs: one field per switch, the same names in the model
                 (`ModelConfig.kernels`), the Hugging Face patch (`apply_fastlm`), `fastlm train
                 --kernels`, the benchmarks and a checkpoint's run record
    precisions   fp32 | bf16 | bf16-weights, with `default_precision` (the one device-dependent default)
    compile      eager | compile | cudagraphs

A switch's values:

    attention  naive | sdpa | fastlm    materialized softmax | torch SDPA | fastlm.flash_attention
    norm       torch | fastlm | auto    PyTorch ops | fastlm.rms_norm | the kernel in eager mode and
                                        PyTorch ops while torch.compile traces (Inductor fuses them
                                        into the residual add before and the cast after)
    rope       torch | fastlm | auto    PyTorch ops | fastlm.rotary_embedding | auto as norm's
    mlp        torch | fastlm | auto    silu(gate) * up by PyTorch ops | fastlm.swiglu | auto as norm's
    loss       torch | fastlm           LM head + F.cross_entropy | fastlm.linear_cross_entropy
    softmax    torch | fastlm           naive attention's mask + softmax | fastlm.masked_softmax
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FUSED_CHOICES = ("torch", "fastlm", "auto")  # a switch whose fused kernel may step aside under torch.compile
SWITCH_CHOICES = {
    "attention": ("naive", "sdpa", "fastlm"),
    "norm": FUSED_CHOICES,
    "rope": FUSED_CHOICES,
    "mlp": FUSED_CHOICES,
    "loss": ("torch", "fastlm"),
    "softmax": ("torch", "fastlm"),
}
SWITCHES = tuple(SWITCH_CHOICES)
KERNEL_SETS = ("torch", "fastlm")  # what `Kernels.named` takes: every switch at once
KERNEL_SETS_HELP = "torch (PyTorch SDPA, norms, RoPE, MLP and loss) or fastlm (fused kernels)"


@dataclass(frozen=True)
class Kernels:
    """Which kernel each layer runs (module docstring); the defaults are PyTorch's everywhere."""

    attention: str = "sdpa"
    norm: str = "torch"
    rope: str = "torch"
    mlp: str = "torch"
    loss: str = "torch"
    softmax: str = "torch"  # used by attention="naive" only

    def __post_init__(self) -> None:
        for name, choices in SWITCH_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")

    @classmethod
    def named(cls, name: str) -> Kernels:
        """A kernel set: "torch" (every default) or "fastlm" (every fused kernel; norm, rope and mlp
        "auto", since under torch.compile Inductor fuses PyTorch's ops into their neighbours, which
        costs less than any separate kernel)."""
        if name == "torch":
            return cls()
        if name == "fastlm":
            return cls(attention="fastlm", norm="auto", rope="auto", mlp="auto", loss="fastlm", softmax="fastlm")
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_SETS)}, got {name!r}")

    def replace(self, **switches: str) -> Kernels:
        """These switches changed (None leaves one as it is), the others kept."""
        return dataclasses.replace(self, **{k: v for k, v in switches.items() if v is not None})

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def runs_fused(switch: str, compiling: bool) -> bool:
    """The one rule for a switch of `FUSED_CHOICES` (and loss, softmax): whether the fused kernel runs
    now. "auto" runs it in eager mode only: while torch.compile traces (``compiling``), PyTorch's
    ops, which Inductor fuses into the kernels around them."""
    return switch == "fastlm" or (switch == "auto" and not compiling)


# How a step runs, for training, the benchmarks and the profilers alike, each mode with its meaning
# (every command's --compile help is made from these)
COMPILE_MEANINGS = {
    "eager": "eager",
    "compile": "compile (torch.compile)",
    "cudagraphs": "cudagraphs (torch.compile(mode='reduce-overhead'): CUDA graphs)",
}
COMPILE_MODES = tuple(COMPILE_MEANINGS)
# the one-line refusal of --compile cudagraphs where no GPU is visible (CUDA graphs capture GPU work)
CUDAGRAPHS_NEED_A_GPU = "--compile cudagraphs needs a GPU (CUDA graphs); without one use --compile compile"
TORCH_COMPILE_MODE = {"compile": "default", "cudagraphs": "reduce-overhead"}  # torch.compile(mode=...) of each

# How a step's numbers are stored (fastlm.model.precision says what each means for a step)
PRECISION_MEANINGS = {
    "fp32": "fp32",
    "bf16": "bf16 (torch.autocast over fp32 weights)",
    "bf16-weights": "bf16-weights (that autocast with the matmul weights stored in bf16 and their fp32 "
    "masters in fastlm's AdamW)",
}
PRECISIONS = tuple(PRECISION_MEANINGS)
# those of tools that step the model's fp32 weights as they are (the profilers, the data-parallel benchmark)
FP32_WEIGHT_PRECISIONS = PRECISIONS[:2]


def default_precision(gpu: bool) -> str:
    """--precision where none is given: bf16 on a GPU; fp32 on a CPU, where bf16 autocast runs slower
    (most cores lack bf16 instructions)."""
    return "bf16" if gpu else "fp32"


def choices_help(meanings: dict[str, str], choices) -> str:
    """ "a, b or c", each choice with its meaning: the help of a --precision or --compile option."""
    listed = [meanings[choice] for choice in choices]
    return listed[0] if len(listed) == 1 else f"{', '.join(listed[:-1])} or {listed[-1]}"


def autocasts(precision: str) -> bool:
    """Whether steps of ``precision`` run under bf16 autocast (activations in 16 bits)."""
    return precision in ("bf16", "bf16-weights")


def stores_bf16_weights(precision: str) -> bool:
    """Whether ``precision`` keeps the matmul weights in bf16, with fp32 masters in the optimizer."""
    return precision == "bf16-weights"
