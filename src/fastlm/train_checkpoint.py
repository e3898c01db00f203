"""The training loop's checkpoints: what `fastlm train` saves (model, optimizer, data position) in
the layout of an unsharded single-process run, through the safe writer of `fastlm.checkpoint`, and
how a resumed run's configuration is checked against the checkpoint's."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError, ConfigMismatchError
from fastlm.train_log import TrainLog
from fastlm.train_options import OVERRIDABLE


def checkpoint_dir(args: argparse.Namespace) -> Path:
    return args.out / "checkpoints"


def training_state(model, optimizer, args) -> dict:
    """{"model", "optimizer"} state dicts in the layout of an unsharded single-process run."""
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    else:
        model_state, optimizer_state = getattr(model, "module", model).state_dict(), optimizer.state_dict()
    return {"model": model_state, "optimizer": optimizer_state}


def restore(state: dict, model, optimizer, args) -> None:
    """Load a `training_state` dict (the learning rate is set by the schedule before every step)."""
    if args.parallel == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)  # fmt: skip
    else:
        getattr(model, "module", model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def save_checkpoint(args, step: int, position: int, config: dict, model, optimizer, rank: int,
                    start_new: bool, log: TrainLog) -> None:  # fmt: skip
    """Every rank takes part (sharded states are gathered); rank 0 writes; if that fails, every rank
    raises its error rather than waiting for rank 0."""
    state = {**training_state(model, optimizer, args), "data": {"position": position}}
    failure = None
    if rank == 0:
        try:
            path = checkpoint.save(checkpoint_dir(args), step, config, state, keep=args.keep_checkpoints,
                                   start_new=start_new)  # fmt: skip
            log.note(f"checkpoint step {step}: {path}")
        except CheckpointError as error:
            failure = str(error)
    if dist.is_initialized():
        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise CheckpointError(failure)


def load_for_resume(args, config: dict) -> checkpoint.Checkpoint:
    newest = checkpoint.newest(checkpoint_dir(args))  # checked first: no --override makes this change possible
    saved = newest["config"].get("precision") if newest else None
    if saved not in (None, args.precision) and "bf16-weights" in (saved, args.precision):
        raise CheckpointError(f"{checkpoint_dir(args)} holds a checkpoint of precision {saved}; a run cannot change "
                              f"to or from bf16-weights (the optimizer state then holds fp32 masters and one more "
                              f"param group)")  # fmt: skip
    try:
        resumed = checkpoint.load(checkpoint_dir(args), config, args.override)
    except ConfigMismatchError as error:
        fixed = [f for f in error.fields if f not in OVERRIDABLE]
        if fixed:
            raise CheckpointError(f"{error}; {', '.join(fixed)} cannot change when resuming") from None
        flags = " ".join(f"--override {f}" for f in error.fields)
        raise CheckpointError(f"{error}; pass {flags} to continue with the change") from None
    if resumed.step > args.steps:
        raise CheckpointError(f"{checkpoint_dir(args)} is at step {resumed.step}, past --steps {args.steps}")
    return resumed
