"""The options of `fastlm train` and `fastlm bench train`, without torch: the CLI builds its parser
from them before any command runs (`fastlm --help` imports neither torch nor Triton).
`fastlm.train` carries them out."""

from __future__ import annotations

import argparse
from pathlib import Path

from fastlm.distributed.wrappers import MODES
from fastlm.model.config import COMPILE_MODES, KERNEL_SETS, PRECISIONS, PRESETS

# configuration fields a resumed run may change on purpose; the others define the model and its data
OVERRIDABLE = ("lr", "min_lr_ratio", "warmup", "steps", "weight_decay", "grad_clip", "batch_tokens", "micro_batch",
               "precision", "kernels", "compile", "seed", "parallel", "world_size", "data")  # fmt: skip
MAX_SEED = 2**32 - 1  # numpy's PCG64 takes any size, torch.manual_seed 64 bits: one range for both


class UsageError(Exception):
    """A mistake in the arguments, or arguments that do not fit the data; one sentence."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fastlm train`; `run` carries them out. Every help names its default."""
    add_loop_arguments(p)
    p.add_argument("--kernels", choices=KERNEL_SETS, default="torch",
                   help="torch (SDPA, PyTorch norm and loss) or fastlm (fused kernels) "
                   "(default: %(default)s)")  # fmt: skip


def add_loop_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of `fastlm train` but --kernels (which a benchmark of kernel sets takes as a list)."""
    p.add_argument("--data", type=Path, required=True, metavar="DIR",
                   help="prepared token data (fastlm data prepare --out) (required)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/train"), metavar="DIR",
                   help="folder for log.jsonl, loss.png, run.json and checkpoints/ (default: %(default)s)")  # fmt: skip
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="model dimensions (default: small on a GPU, tiny without one)")  # fmt: skip
    for flag, what in (("--d-model", "width"), ("--d-ff", "MLP hidden width"), ("--layers", "Transformer blocks"),
                       ("--heads", "attention heads")):  # fmt: skip
        p.add_argument(flag, type=int, default=None, help=f"{what} (default: the preset's)")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per process per forward and backward (default: %(default)s)")  # fmt: skip
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="global batch in tokens, a multiple of --context x --micro-batch x processes, reached by "
                   "gradient accumulation (default: --context x --micro-batch x processes, no "
                   "accumulation)")  # fmt: skip
    p.add_argument("--steps", type=int, default=1000,
                   help="optimizer steps of the run; the cosine ends there (default: %(default)s)")  # fmt: skip
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decays to this fraction of --lr (default: %(default)s)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=100, help="steps of linear warmup (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of matrices and embeddings (default: %(default)s)")  # fmt: skip
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="clip the global gradient norm to this; 0: no clipping (default: %(default)s)")  # fmt: skip
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="eager, compile (torch.compile) or cudagraphs (mode reduce-overhead) (default: compile on "
                   "a GPU, eager without one)")  # fmt: skip
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="bf16 runs the forward under torch.autocast, weights and optimizer state in fp32; "
                   "bf16-weights the same autocast with the matmul weights stored in bf16 and their fp32 masters "
                   "in fastlm's AdamW (not with --parallel fsdp or --shard-optimizer) (default: bf16 on a GPU, "
                   "fp32 without one)")  # fmt: skip
    p.add_argument("--parallel", choices=MODES, default="none",
                   help="how gradients are synchronized across processes; anything but none needs torchrun "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket size of --parallel bucketed and torch-ddp (default: %(default)s)")  # fmt: skip
    p.add_argument("--shard-optimizer", action="store_true",
                   help="shard AdamW's state across processes (ShardedOptimizer); not with --parallel "
                   "fsdp")  # fmt: skip
    p.add_argument("--log-every", type=int, default=10, help="steps per log line and record (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=200,
                   help="steps between evaluations on the held-out split, also done before the first step and "
                   "after the last; 0: only those (default: %(default)s)")  # fmt: skip
    p.add_argument("--eval-sequences", type=int, default=64,
                   help="held-out windows per evaluation, the first ones of the split "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--checkpoint-every", type=int, default=1000,
                   help="steps between checkpoints, also saved after the last step; 0: no checkpoints "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--keep-checkpoints", type=int, default=2,
                   help="how many of the newest checkpoints to keep (default: %(default)s)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue the run of the newest checkpoint in OUT")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an OUT that holds checkpoints; they are deleted once the new run has "
                   "saved its first")  # fmt: skip
    p.add_argument("--override", action="append", choices=OVERRIDABLE, default=[], metavar="FIELD",
                   help=f"with --resume, accept a change of FIELD from the checkpoint's run (repeatable; one of "
                   f"{', '.join(OVERRIDABLE)}) (default: none)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initial weights and the order of the windows (default: %(default)s)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="a collective that waits longer (a process died or hangs) fails instead of hanging "
                   "(default: %(default)s)")  # fmt: skip
    p.set_defaults(prog=p.prog)


def _kernel_sets(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in KERNEL_SETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(KERNEL_SETS)}, got {text!r}")
    return names


def add_kernel_comparison_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fastlm train`, with --kernels a list of kernel sets to compare."""
    add_loop_arguments(p)
    p.add_argument("--kernels", type=_kernel_sets, default=KERNEL_SETS,
                   help="comma list of kernel sets, each trained from the same start "
                   "(default: torch,fastlm)")  # fmt: skip
