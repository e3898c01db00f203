"""The vocabularies every part of fastlm speaks, without torch (the command line builds its parsers
from these before anything imports torch):

    Kernels      which kernel each layer runs: one field per switch, the same names in the model
                 (`ModelConfig.kernels`), the Hugging Face patch (`apply_fastlm`), `fastlm train
                 --kernels`, the benchmarks and a checkpoint's run record
    precisions   fp32 | bf16 | bf16-weights, with `default_precision` (the one device-dependent default)
                 and `STATE_BYTES`, the training state each keeps per parameter
    compile      eager | compile | cudagraphs
    parallel     how `fastlm train` averages gradients across processes (`PARALLEL`; a run's
                 choice is a `ParallelSpec`; `fastlm.distributed.wrappers` runs each mode):
        none        one process, no averaging
        naive       `allreduce_gradients` after backward, one all-reduce per parameter
        flat        the same, all gradients flattened into one buffer and one all-reduce
        ddp         fastlm `DDP`: an async all-reduce per parameter, started from its gradient hook
        bucketed    fastlm `BucketedDDP`, buckets of `bucket_mb` MB
        torch-ddp   PyTorch `DistributedDataParallel`, buckets of `bucket_mb` MB
        fsdp        PyTorch FSDP2 `fully_shard` on units of consecutive blocks of at least `bucket_mb`
                    MB of gathered weights and on the root: parameters, gradients and optimizer
                    state sharded

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
import math
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
    "fp8": "fp8 (bf16 autocast with the blocks' linear layers through fastlm.fp8_linear: FP8 matmuls, "
    "tensorwise scales)",
}
PRECISIONS = tuple(PRECISION_MEANINGS)
# those of tools that step the model's fp32 weights as they are (the profilers, the data-parallel benchmark)
FP32_WEIGHT_PRECISIONS = PRECISIONS[:2]
# those of tools that run every precision's step on one model as it was built (`fastlm bench model`)
ONE_MODEL_PRECISIONS = PRECISIONS[:3]


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
    return precision in ("bf16", "bf16-weights", "fp8")


def uses_fp8(precision: str) -> bool:
    """Whether ``precision`` runs the blocks' linear layers through fastlm.fp8_linear."""
    return precision == "fp8"


def stores_bf16_weights(precision: str) -> bool:
    """Whether ``precision`` keeps the matmul weights in bf16, with fp32 masters in the optimizer."""
    return precision == "bf16-weights"


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of the training state a precision keeps (PyTorch's AdamW, or fastlm's
    for bf16-weights), before any sharding: the one table of every memory estimate."""

    weights: int
    gradients: int
    optimizer: int  # AdamW's two fp32 moments; with bf16-weights also the fp32 master weights

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


STATE_BYTES = {
    "fp32": StateBytes(4, 4, 8),
    "bf16": StateBytes(4, 4, 8),  # autocast computes in bf16 from the fp32 weights
    "bf16-weights": StateBytes(2, 2, 12),
    "fp8": StateBytes(4, 4, 8),  # fp32 weights; only the matmuls' operands are FP8, made per step
}


@dataclass(frozen=True)
class Parallelism:
    """What the configuration and the memory estimates know of a --parallel mode without running it
    (`fastlm.distributed.wrappers.parallel_mode` runs it)."""

    processes: bool = True  # one process per GPU (torchrun), gradients averaged; False: one process
    bucket_mb: float | None = None  # bucket (fsdp: unit) size without --bucket-mb; None: no buckets
    compiled_bucket_mb: float | None = None  # bucket_mb where the whole model is one graph (None: the same)
    needs_bucket_mb: bool = False  # a spec must give the size (the wrapper has no default of its own)
    shards_state: bool = False  # parameters, gradients and optimizer state divided over the processes


# bucketed's size where the model is compiled as one graph: every gradient arrives at the end of its
# backward, so small buckets overlap nothing and only add all-reduce calls and their fixed costs.
# 500 MB holds the small preset's 455 MB of fp32 gradients in one bucket; larger models get a few.
COMPILED_BUCKETED_MB = 500.0
# The modes (module docstring). Bucket sizes in MB of 1e6 bytes. fsdp: small blocks are bound by the
# host's per-unit work (hooks, collectives' launches), so units gather blocks up to 120 MB (the small
# preset: one unit of all 12 blocks, the fastest measured, docs/notes/distributed.md); blocks of
# 120 MB and more stay alone.
PARALLEL = {
    "none": Parallelism(processes=False),
    "naive": Parallelism(),
    "flat": Parallelism(),
    "ddp": Parallelism(),
    "bucketed": Parallelism(bucket_mb=25.0, compiled_bucket_mb=COMPILED_BUCKETED_MB, needs_bucket_mb=True),
    "torch-ddp": Parallelism(bucket_mb=25.0),  # without bucket_mb in a spec: PyTorch's own 25
    "fsdp": Parallelism(bucket_mb=120.0, shards_state=True),
}
PARALLEL_MODES = tuple(PARALLEL)
BUCKETED_MODES = tuple(name for name, mode in PARALLEL.items() if mode.bucket_mb is not None)
DEFAULT_BUCKET_MB = {name: PARALLEL[name].bucket_mb for name in BUCKETED_MODES}  # `fastlm train`'s
REDUCE_DTYPES = ("fp32", "bf16")  # what gradients are averaged in across ranks


def bucket_mb_in_use(mode: str, bucket_mb: float | None, compiled: bool = False) -> float | None:
    """The bucket (fsdp: unit) size a mode runs with: ``bucket_mb`` or the mode's default (bucketed's
    under torch.compile of the whole model where ``compiled``); None for the modes without buckets."""
    parallelism = PARALLEL[mode]
    if parallelism.bucket_mb is None:
        return None
    if bucket_mb:
        return bucket_mb
    if compiled and parallelism.compiled_bucket_mb is not None:
        return parallelism.compiled_bucket_mb
    return parallelism.bucket_mb


@dataclass(frozen=True)
class ParallelSpec:
    """A parallel mode (one of PARALLEL_MODES), for the bucketed ones the bucket size in MB, the
    dtype the gradients are averaged in (one of REDUCE_DTYPES: fp32, or bf16 to halve the bytes),
    and whether AdamW's state is sharded across the processes (`ShardedOptimizer`)."""

    mode: str
    bucket_mb: float | None = None
    reduce_dtype: str = "fp32"
    shard_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.mode not in PARALLEL:
            raise ValueError(f"unknown parallel mode {self.mode!r}; known: {', '.join(PARALLEL_MODES)}")
        parallelism = PARALLEL[self.mode]
        if parallelism.needs_bucket_mb and self.bucket_mb is None:
            raise ValueError(f"parallel mode {self.mode} needs bucket_mb, the bucket size in MB")
        if self.bucket_mb is not None and parallelism.bucket_mb is None:
            raise ValueError(f"parallel mode {self.mode} takes no bucket_mb; only {', '.join(BUCKETED_MODES)} do")
        if self.bucket_mb is not None and not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"bucket_mb must be a positive finite number of MB, got {self.bucket_mb}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.reduce_dtype != "fp32" and not parallelism.processes:
            raise ValueError(f"parallel mode {self.mode} averages no gradients: reduce_dtype must stay fp32")
        if self.shard_optimizer and (parallelism.shards_state or not parallelism.processes):
            raise ValueError(f"parallel mode {self.mode} takes no shard_optimizer")

    @property
    def parallelism(self) -> Parallelism:
        return PARALLEL[self.mode]
