"""`TrainConfig`: every setting of a training run as one typed dataclass. The command line of
`fastlm train` (and `python -m fastlm.train`) is generated from its fields (`add_arguments`), the
loop reads it, and a checkpoint records the part a resumed run must share (`run_record`), which
`--resume` compares; `RewardConfig` does the same for `fastlm train reward`. Without torch:
`fastlm --help` builds the parser before any command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from fastlm.model.config import ModelConfig
from fastlm.model.options import ModelOptions
from fastlm.settings import (
    BUCKETED_MODES,
    COMPILE_MEANINGS,
    COMPILE_MODES,
    COMPILED_BUCKETED_MB,
    DEFAULT_BUCKET_MB,
    FP32_WEIGHT_PRECISIONS,
    KERNEL_SETS,
    KERNEL_SETS_HELP,
    PARALLEL,
    PARALLEL_MODES,
    PRECISION_MEANINGS,
    PRECISIONS,
    REDUCE_DTYPES,
    TORCH_COMPILE_MODE,
    Parallelism,
    ParallelSpec,
    bucket_mb_in_use,
    choices_help,
    default_precision,
    stores_bf16_weights,
    uses_fp8,
)
from fastlm.utils.errors import UserError
from fastlm.utils.options import add_options, check_limits, option

VOCAB_MULTIPLE = 64  # the model's vocabulary is the data's rounded up to it (tensor-core-friendly shapes)
# fields of `run_record` a resumed run may change on purpose; the others define the model and its data
OVERRIDABLE = (
    "lr",
    "min_lr_ratio",
    "warmup",
    "steps",
    "weight_decay",
    "grad_clip",
    "batch_tokens",
    "micro_batch",
    "precision",
    "kernels",
    "compile",
    "seed",
    "parallel",
    "reduce_dtype",
    "recompute",
    "world_size",
    "data",
)
NEWEST = "newest"  # --resume's value for the newest checkpoint
# fields of `run_record` that checkpoints of older versions lack, with what those runs did
IMPLIED_BY_OLDER_RUNS = {
    "documents": False,
    "window": None,
    "global_every": 0,
    "reduce_dtype": "fp32",
    "recompute": False,
}


def checkpoint_step(text: str) -> int | str:
    """--resume's value: "newest" (what --resume alone means) or a checkpoint's step."""
    if text == NEWEST:
        return text
    step = int(text) if text.isdigit() else 0
    if step < 1:
        raise argparse.ArgumentTypeError(
            f"expected newest or the step of a checkpoint (a positive integer), got {text!r}"
        )
    return step


@dataclass
class TrainConfig(ModelOptions):
    """A training run; the model fields (preset, dimensions, context) come from `ModelOptions`."""

    data: Path | None = option(
        None, "prepared token data (fastlm data prepare --out) (required)", required=True, metavar="DIR"
    )
    out: Path = option(
        Path("runs/train"), "folder of the run: log.jsonl, loss.png, run.json and checkpoints/", metavar="DIR"
    )
    kernels: str = option("torch", KERNEL_SETS_HELP, choices=KERNEL_SETS)
    documents: bool = option(
        True,
        "attention stays inside each document of a window (documents start at the data's boundary id); "
        "--no-documents: each window is one sequence (default: on)",
        action=argparse.BooleanOptionalAction,
    )
    micro_batch: int = option(8, "sequences per process per forward and backward", limit="positive")
    recompute: bool = option(
        False,
        "activation checkpointing: backward runs each block's forward again, so only the blocks' inputs are "
        "kept (about a third more compute, a fraction of the activation memory)",
    )
    batch_tokens: int | None = option(
        None,
        "global batch in tokens, a multiple of --context x --micro-batch x processes, reached by gradient "
        "accumulation (default: --context x --micro-batch x processes, no accumulation)",
        limit="positive",
    )
    steps: int = option(1000, "optimizer steps of the run; the cosine ends there", limit="positive")
    lr: float = option(6e-4, "peak AdamW learning rate", limit="positive")
    min_lr_ratio: float = option(0.1, "the cosine decays to this fraction of --lr", limit="fraction")
    warmup: int = option(100, "steps of linear warmup", limit="non_negative")
    weight_decay: float = option(0.1, "AdamW weight decay of matrices and embeddings", limit="non_negative")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0: no clipping", limit="non_negative")
    skip_non_finite: int = option(
        0,
        "a step whose loss or gradient norm is not finite (inf, nan) makes no update, counted in the log, up "
        "to N such steps in a row, then the run stops; checked every step, so the host waits for the "
        "device once per step (default: 0, the run stops at the first such step, checked at log steps and "
        "before checkpoints without extra waits; --skip-non-finite alone: 10)",
        limit="non_negative",
        nargs="?",
        const=10,
        metavar="N",
    )
    compile: str | None = option(
        None,
        f"{choices_help(COMPILE_MEANINGS, COMPILE_MODES)} (default: compile on a GPU, eager without one)",
        choices=COMPILE_MODES,
    )
    precision: str | None = option(
        None,
        f"{choices_help(PRECISION_MEANINGS, PRECISIONS)}; bf16-weights not with --parallel fsdp or "
        "--shard-optimizer, fp8 not with --parallel fsdp (default: bf16 on a GPU, fp32 without one)",
        choices=PRECISIONS,
    )
    parallel: str = option(
        "none",
        "how gradients are synchronized across processes; anything but none needs torchrun",
        choices=PARALLEL_MODES,
    )
    bucket_mb: float | None = option(
        None,
        "bucket size of --parallel bucketed and torch-ddp; with fsdp the least MB of gathered weights "
        "per sharding unit of consecutive blocks (default: "
        f"{DEFAULT_BUCKET_MB['bucketed']:g} for bucketed and torch-ddp, {COMPILED_BUCKETED_MB:g} for bucketed "
        f"when compiled (the default on a GPU), {DEFAULT_BUCKET_MB['fsdp']:g} for fsdp)",
        limit="positive",
    )
    reduce_dtype: str = option(
        "fp32",
        "dtype the gradients are averaged in across processes: bf16 halves the bytes at bf16's precision",
        choices=REDUCE_DTYPES,
    )
    shard_optimizer: bool = option(
        False, "shard AdamW's state across processes (ShardedOptimizer); not with --parallel fsdp"
    )
    log_every: int = option(10, "steps per log line and record", limit="positive")
    eval_every: int = option(
        200,
        "steps between evaluations on the held-out split, also done before the first "
        "step and after the last; 0: only those",
        limit="non_negative",
    )
    eval_sequences: int = option(
        64,
        "held-out windows per evaluation, the first ones of the split; a multiple of --micro-batch x "
        "processes, at least one",
        limit="positive",
    )
    checkpoint_every: int = option(
        1000, "steps between checkpoints, also saved after the last step; 0: no checkpoints", limit="non_negative"
    )
    keep_checkpoints: int = option(2, "how many of the newest checkpoints to keep", limit="positive")
    resume: int | str | None = option(
        None,
        "continue the run of OUT from its newest checkpoint, or from the kept checkpoint of step STEP "
        "(default: start a new run; --resume alone: newest)",
        type=checkpoint_step,
        nargs="?",
        const=NEWEST,
        metavar="STEP",
    )
    overwrite: bool = option(
        False,
        "start a new run in an OUT that holds one: the old run's files are moved to "
        "OUT/previous-* and deleted once the new run has saved its first checkpoint (or "
        "ended, without checkpoints)",
    )
    override: list[str] = option(
        [],
        "with --resume, accept a change of FIELD from the checkpoint's run "
        f"(repeatable; one of {', '.join(OVERRIDABLE)}) (default: none)",
        choices=OVERRIDABLE,
        metavar="FIELD",
    )
    seed: int = option(0, "seeds the initial weights and the order of the windows", limit="seed")
    timeout_s: float = option(
        600.0, "a collective that waits longer (a process died or hangs) fails instead of hanging", limit="positive"
    )

    def resolved(self, gpu: bool) -> TrainConfig:
        """A copy with the device-dependent defaults filled in (preset, precision, compile)."""
        defaults = {
            "preset": "small" if gpu else "tiny",
            "precision": default_precision(gpu),
            "compile": "compile" if gpu else "eager",
        }
        return dataclasses.replace(self, **{k: getattr(self, k) or v for k, v in defaults.items()})

    def check(self, world: int) -> None:
        """UserError, naming the option, for values out of range and options that do not combine
        (on a `resolved` config of ``world`` processes)."""
        if self.data is None:
            raise UserError("--data is required")
        check_limits(self)
        self.model_config(vocab_size=1)
        per_micro_step = self.context * self.micro_batch * world
        if self.batch_tokens is not None and self.batch_tokens % per_micro_step:
            raise UserError(
                f"--batch-tokens must be a positive multiple of --context x --micro-batch x processes = "
                f"{self.context} x {self.micro_batch} x {world} = {per_micro_step}, "
                f"got {self.batch_tokens}"
            )
        if self.compile == "cudagraphs" and (self.parallelism.processes or self.accumulation(world) > 1):
            raise UserError(
                "--compile cudagraphs needs --parallel none and no gradient accumulation (--batch-tokens "
                "= --context x --micro-batch): a graph's gradients are overwritten by its next "
                "replay"
            )
        sharded = self.parallelism.shards_state
        if stores_bf16_weights(self.precision) and (sharded or self.shard_optimizer):
            raise UserError(
                "--precision bf16-weights does not combine with --parallel fsdp or --shard-optimizer "
                "(they shard the optimizer state, which would have to hold the fp32 masters)"
            )
        if uses_fp8(self.precision) and sharded:
            raise UserError(
                "--precision fp8 does not combine with --parallel fsdp yet (FP8 matmuls over sharded "
                "weights); use another --parallel mode"
            )
        if sharded and self.shard_optimizer:
            raise UserError(
                "--shard-optimizer does not combine with --parallel fsdp (FSDP already shards the optimizer state)"
            )
        if self.reduce_dtype != "fp32" and not self.parallelism.processes:
            raise UserError("--reduce-dtype needs a --parallel mode: one process averages no gradients")
        if self.shard_optimizer and not self.parallelism.processes:
            raise UserError(
                "--shard-optimizer needs a --parallel mode: one process has no others to share AdamW's state"
            )
        if self.bucket_mb is not None and self.parallel not in BUCKETED_MODES:
            raise UserError(
                f"--bucket-mb sizes the buckets of --parallel bucketed and torch-ddp and the units of fsdp; "
                f"--parallel {self.parallel} has none"
            )
        if self.out.resolve() == self.data.resolve():
            raise UserError(f"--out must be a folder of its own, not the --data folder {self.data}")
        if self.override and not self.resume:
            raise UserError("--override needs --resume")
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite exclude each other: continue the checkpoint's run, or replace it")

    @property
    def parallelism(self) -> Parallelism:
        """What the --parallel mode is (`fastlm.settings.PARALLEL`)."""
        return PARALLEL[self.parallel]

    def parallel_spec(self) -> ParallelSpec:
        """The --parallel mode as `fastlm.distributed.wrappers` takes it: --bucket-mb or the mode's
        default, bucketed's depending on whether the model is compiled (on a `resolved` config),
        --reduce-dtype and --shard-optimizer."""
        compiled = self.compile in TORCH_COMPILE_MODE
        bucket_mb = bucket_mb_in_use(self.parallel, self.bucket_mb, compiled)
        return ParallelSpec(self.parallel, bucket_mb, self.reduce_dtype, self.shard_optimizer)

    def max_grad_norm(self) -> float:
        """The global gradient norm clipping scales down to: --grad-clip, whose 0 means no limit."""
        return self.grad_clip or math.inf

    def batch_tokens_of(self, world: int) -> int:
        """The global batch in tokens: --batch-tokens, or one micro-batch per process."""
        return self.batch_tokens or self.context * self.micro_batch * world

    def accumulation(self, world: int) -> int:
        """Micro-batches per process per step."""
        return self.batch_tokens_of(world) // (self.context * self.micro_batch * world)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The preset with any dimension given and the kernels chosen; the data's vocabulary rounded up."""
        padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        config = super().model_config(self.preset, padded).with_kernels(self.kernels)
        return dataclasses.replace(config, recompute=self.recompute)

    def run_record(self, world: int, data_sha256: str, tokenizer: str, vocab_size: int) -> dict:
        """What a resumed run must share with the run that wrote the checkpoint to continue it
        exactly (JSON data; `OVERRIDABLE` names the fields a resumed run may change)."""
        dims = dataclasses.asdict(self.model_config(vocab_size))
        del dims["kernels"]  # the kernels field says which
        return {
            "data": data_sha256[:16],
            "tokenizer": tokenizer,
            "preset": self.preset,
            **dims,
            "batch_tokens": self.batch_tokens_of(world),
            "micro_batch": self.micro_batch,
            "precision": self.precision,
            "kernels": self.kernels,
            "documents": self.documents,
            "reduce_dtype": self.reduce_dtype,
            "compile": self.compile,
            "seed": self.seed,
            "lr": self.lr,
            "min_lr_ratio": self.min_lr_ratio,
            "warmup": self.warmup,
            "steps": self.steps,
            "weight_decay": self.weight_decay,
            "grad_clip": self.grad_clip,
            "parallel": self.parallel,
            "world_size": world,
        }


@dataclass
class RewardConfig(ModelOptions):
    """A reward-model run; the model fields (preset, dimensions, context) come from `ModelOptions`."""

    data: Path | None = option(
        None,
        "JSONL of {prompt, chosen, rejected} or {prompt, responses: [best, ..., worst]} lines (required)",
        required=True,
        metavar="FILE",
    )
    out: Path = option(Path("runs/reward"), "folder of the run: log.jsonl and reward_model.pt", metavar="DIR")
    batch: int = option(16, "prompts per optimizer step", limit="positive")
    steps: int = option(300, "optimizer steps of the run; the cosine ends there", limit="positive")
    lr: float = option(1e-3, "peak AdamW learning rate", limit="positive")
    min_lr_ratio: float = option(0.1, "the cosine decays to this fraction of --lr", limit="fraction")
    warmup: int = option(20, "steps of linear warmup", limit="non_negative")
    weight_decay: float = option(0.0, "AdamW weight decay of matrices and embeddings", limit="non_negative")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0: no clipping", limit="non_negative")
    held_out: float = option(
        0.1, "fraction of the prompts held out for the pairwise accuracy (at least one)", limit="fraction"
    )
    log_every: int = option(10, "steps per log line and record", limit="positive")
    eval_every: int = option(
        100, "steps between accuracy evaluations, also done after the last step; 0: only then", limit="non_negative"
    )
    precision: str | None = option(
        None,
        f"{choices_help(PRECISION_MEANINGS, FP32_WEIGHT_PRECISIONS)} (default: bf16 on a GPU, fp32 without one)",
        choices=FP32_WEIGHT_PRECISIONS,
    )
    seed: int = option(0, "seeds the initial weights, the held-out split and the batches", limit="seed")
    overwrite: bool = option(
        False,
        "start a new run in an OUT that holds one: the old run's log.jsonl and "
        "reward_model.pt are moved to OUT/previous-* first",
    )

    def model_config(self, preset: str, vocab_size: int) -> ModelConfig:
        """``preset`` with any dimension given; the vocabulary rounded up as in `fastlm train`."""
        return super().model_config(preset, -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


def add_arguments(parser, exclude=(), overrides: dict | None = None) -> None:
    """The options of `fastlm train`, one per field of `TrainConfig` (``exclude`` and ``overrides``:
    `fastlm.utils.options.add_options`)."""
    add_options(parser, TrainConfig, exclude, overrides)
