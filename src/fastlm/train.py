"""`python -m fastlm.train`: train the language model on one or many processes.

    torchrun --nproc-per-node 4 -m fastlm.train --preset xl --parallel bucketed --bucket-mb 25
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m fastlm.train ...

Data parallelism: every rank holds the model and takes its slice of each global batch; the global
batch of step s is drawn from a generator seeded by (seed, s), so a run's data does not depend on
the number of ranks and a resumed run sees exactly the batches it would have seen. `--parallel`:
none (one process), naive / flat (`allreduce_gradients` after backward, per parameter / flattened),
ddp / bucketed (fastlm's overlapping wrappers), torch-ddp (PyTorch's DistributedDataParallel),
fsdp (PyTorch's FSDP2 `fully_shard`, per block and the root: parameters, gradients and optimizer
state sharded, for models that do not fit one GPU). `--shard-optimizer` wraps AdamW in
`ShardedOptimizer`.

Checkpoints (`--checkpoint DIR`, see `fastlm.checkpoint`): every rank takes part in gathering the
state, rank 0 writes it, verifies it and commits it, keeping the last `--keep-checkpoints`; a
process killed at any moment leaves the committed checkpoints whole. A folder that already holds
a checkpoint is only continued (`--resume`) or replaced (`--overwrite`). A checkpoint records the
run's configuration (model dimensions, batch, precision, seed, learning rate, parallel mode, world
size); `--resume` continues exactly and refuses a run that differs, unless each change is named
with `--override FIELD`. Mistakes in the arguments and unusable checkpoints end the command with a
one-line error.

Tokens are synthetic (uniform ids, next-token targets): this entry point measures and checks the
parallel machinery; `fastlm train ar` and the text-corpus trainer are about what the model learns.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError, ConfigMismatchError
from fastlm.distributed import DDP, BucketedDDP, ShardedOptimizer, allreduce_gradients
from fastlm.distributed.launch import exit_process
from fastlm.model import PRESETS, ModelConfig, TransformerLM

PROG = "python -m fastlm.train"
PARALLEL = ("none", "naive", "flat", "ddp", "bucketed", "torch-ddp", "fsdp")
# configuration fields a resumed run may change on purpose; the others define the model's parameters
OVERRIDABLE = ("lr", "batch", "precision", "seed", "parallel", "world_size")
MAX_SEED = 2**32 - 1  # the batch generator is seeded with seed * 1_000_003 + step, which must fit 64 bits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="model dimensions (fastlm.model presets)")
    p.add_argument("--vocab", type=int, default=10000, help="vocabulary size; tokens are uniform in [0, vocab)")
    p.add_argument("--context", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="train until this many steps are done (a resumed run counts the checkpoint's)",
    )
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, constant")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16 runs the forward pass under torch.autocast; weights and optimizer stay fp32",
    )
    p.add_argument(
        "--parallel",
        choices=PARALLEL,
        default="none",
        help="how gradients are synchronized across ranks (anything but none needs torchrun)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of --parallel bucketed and torch-ddp")
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="shard AdamW's state across ranks (ShardedOptimizer); not with --parallel fsdp",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="DIR",
        help="checkpoint folder, written every --checkpoint-every steps and at the end",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints; 0: only at the end")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many of the newest checkpoints to keep")
    p.add_argument("--resume", action="store_true", help="continue the run of the newest checkpoint in --checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a --checkpoint folder that holds checkpoints; they are deleted "
        "once the new run has saved its first",
    )
    p.add_argument(
        "--override",
        action="append",
        choices=OVERRIDABLE,
        default=[],
        metavar="FIELD",
        help=f"with --resume, accept a change of FIELD from the checkpoint's run (repeatable; "
        f"one of {', '.join(OVERRIDABLE)})",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and every step's batch")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="a collective that waits longer (a rank died or hangs) fails instead of hanging",
    )
    args = p.parse_args(argv)
    for name in ("vocab", "context", "batch", "steps", "keep_checkpoints"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("lr", "bucket_mb", "timeout_s"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be 0 (only at the end) or more, got {args.checkpoint_every}")
    if not 0 <= args.seed <= MAX_SEED:
        p.error(f"--seed must be between 0 and {MAX_SEED}, got {args.seed}")
    if args.parallel == "fsdp" and args.shard_optimizer:
        p.error("--shard-optimizer does not combine with --parallel fsdp (FSDP already shards the optimizer state)")
    if args.override and not args.resume:
        p.error("--override needs --resume")
    if args.checkpoint is None:
        for flag in ("resume", "overwrite", "checkpoint_every"):
            if getattr(args, flag):
                p.error(f"--{flag.replace('_', '-')} needs --checkpoint")
        return args
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite exclude each other: continue the checkpoint's run, or replace it")
    try:
        existing = checkpoint.newest(args.checkpoint)
    except CheckpointError as error:
        if not args.overwrite or args.checkpoint.is_file():  # --overwrite replaces checkpoints, no other file
            p.error(str(error))
        existing = None
    if existing is not None and not (args.resume or args.overwrite):
        p.error(f"{args.checkpoint} holds a checkpoint (step {existing['step']}): pass --resume to continue "
                "its run or --overwrite to replace it")  # fmt: skip
    return args


def model_config(args) -> ModelConfig:
    return ModelConfig.preset(args.preset, vocab_size=args.vocab, context_length=args.context)


def run_config(args, world: int) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint to continue it exactly."""
    model = dataclasses.asdict(model_config(args))
    return {"preset": args.preset, **model, "batch": args.batch, "precision": args.precision, "seed": args.seed,
            "lr": args.lr, "lr_schedule": "constant", "parallel": args.parallel, "world_size": world}  # fmt: skip


def _rank_and_world(args) -> tuple[int, int]:
    if args.parallel == "none":
        return 0, 1
    if "RANK" not in os.environ:
        raise SystemExit(f"{PROG}: error: --parallel {args.parallel} needs torchrun (RANK / WORLD_SIZE are not set)")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _setup(args) -> torch.device:
    """The device of this rank; initializes torch.distributed unless --parallel none."""
    if args.parallel == "none":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=args.timeout_s))
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _wrap(model: torch.nn.Module, args, device: torch.device) -> torch.nn.Module:
    if args.parallel == "ddp":
        return DDP(model)
    if args.parallel == "bucketed":
        return BucketedDDP(model, args.bucket_mb)
    if args.parallel == "torch-ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_mb)
    if args.parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return model


def batch_for_step(step: int, args, rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (batch * world sequences)."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, args.vocab, (args.batch * world, args.context + 1), generator=generator)
    mine = tokens[rank * args.batch : (rank + 1) * args.batch]
    return mine[:, :-1].to(device), mine[:, 1:].to(device)


def _state(model, optimizer, args) -> dict:
    """{"model", "optimizer"} state dicts in the layout of an unsharded single-process run."""
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    else:
        model_state, optimizer_state = getattr(model, "module", model).state_dict(), optimizer.state_dict()
    return {"model": model_state, "optimizer": optimizer_state}


def _restore(state: dict, model, optimizer, args) -> None:
    """Load a `_state` dict, then set the learning rate of this run (equal to the saved one unless
    --override lr changed it)."""
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)  # fmt: skip
    else:
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = args.lr


def save_checkpoint(args, step: int, config: dict, model, optimizer, rank: int, start_new: bool) -> None:
    """Every rank takes part (sharded states are gathered); rank 0 writes; if that fails, every rank
    raises its error rather than waiting for rank 0."""
    state = _state(model, optimizer, args)
    failure = None
    if rank == 0:
        try:
            path = checkpoint.save(args.checkpoint, step, config, state, keep=args.keep_checkpoints,
                                   start_new=start_new)  # fmt: skip
            print(f"checkpoint step {step}: {path}", flush=True)
        except CheckpointError as error:
            failure = str(error)
    if dist.is_initialized():
        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise CheckpointError(failure)


def _load_for_resume(args, config: dict) -> checkpoint.Checkpoint:
    try:
        resumed = checkpoint.load(args.checkpoint, config, args.override)
    except ConfigMismatchError as error:
        fixed = [f for f in error.fields if f not in OVERRIDABLE]
        if fixed:
            raise CheckpointError(f"{error}; {', '.join(fixed)} cannot change when resuming") from None
        flags = " ".join(f"--override {f}" for f in error.fields)
        raise CheckpointError(f"{error}; pass {flags} to continue with the change") from None
    if resumed.step > args.steps:
        raise CheckpointError(f"{args.checkpoint} is at step {resumed.step}, past --steps {args.steps}")
    return resumed


def train(args) -> dict:
    """Run the training loop; returns {"step", "losses"} (rank-averaged loss per step) on every rank."""
    rank, world = _rank_and_world(args)
    config = run_config(args, world)
    # verified before the process group exists, so a bad checkpoint stops every rank with its message
    resumed = _load_for_resume(args, config) if args.resume else None
    if resumed is not None and resumed.step == args.steps:
        if rank == 0:
            print(f"{args.checkpoint} is at step {resumed.step} of {args.steps}: nothing to train", flush=True)
        return {"step": resumed.step, "losses": []}
    device = _setup(args)
    try:
        # The loop's model, wrapper and optimizer are freed when it returns, while the process group
        # is still registered. Freed after destroy_process_group, PyTorch DDP's reducer would drop the
        # group's last reference, and the group's destructor joins gloo threads that wait for the GIL
        # the freeing thread holds: a hang at exit.
        pending = [resumed]  # handed over, so the loop can free the loaded tensors once restored
        del resumed
        return _train_loop(args, config, pending, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_loop(args, config: dict, pending: list, rank: int, world: int, device: torch.device) -> dict:
    """The steps; ``pending`` holds the checkpoint to resume from (or None), taken out here."""
    resumed = pending.pop()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = _wrap(TransformerLM(model_config(args)).to(device), args, device)
    if args.shard_optimizer:
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = 0
    if resumed is not None:
        _restore(resumed.state, model, optimizer, args)
        step, resumed = resumed.step, None  # drop the loaded tensors: the model holds them now
    start_new = not args.resume  # the first save of a new run replaces the folder's older checkpoints
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    losses = []
    while step < args.steps:
        tokens, targets = batch_for_step(step, args, rank, world, device)
        with autocast:
            loss = model(tokens, targets)
        loss.backward()
        if args.parallel in ("naive", "flat"):
            allreduce_gradients(model, flat=args.parallel == "flat")
        elif args.parallel in ("ddp", "bucketed"):
            model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        reported = loss.detach().float()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
        if rank == 0:
            print(f"step {step}/{args.steps} loss {losses[-1]:.4f}", flush=True)
        last = step == args.steps
        if args.checkpoint is not None and (last or args.checkpoint_every and step % args.checkpoint_every == 0):
            save_checkpoint(args, step, config, model, optimizer, rank, start_new)
            start_new = False
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while another still has collectives in flight
    return {"step": step, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except CheckpointError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process
