"""The training loop's checkpoints: what `fastlm train` saves (model, optimizer, data position, run id)
in the layout of an unsharded single-process run, through the safe writer of `fastlm.checkpoint`;
what OUT must hold for a run to start or resume; how a resumed run's configuration and files
are checked against the checkpoint's; and what a stopped run leaves (Ctrl-C, SIGTERM, a loss or
state that is no longer finite), in one sentence."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError, ConfigMismatchError, DamagedCheckpointError
from fastlm.distributed import ShardedOptimizer
from fastlm.distributed.wrappers import parallel_mode
from fastlm.settings import stores_bf16_weights
from fastlm.train.config import IMPLIED_BY_OLDER_RUNS, NEWEST, OVERRIDABLE, TrainConfig
from fastlm.train.log import TrainLog, run_files, run_id, set_aside_runs
from fastlm.utils.errors import UserError
from fastlm.utils.options import flag
from fastlm.utils.paths import check_writable_folder


class NonFiniteError(Exception):
    """The run's loss, gradient norm or state is no longer finite (inf or nan): the run stops, and no
    checkpoint holds the state that produced it. The message is one sentence."""


def checkpoint_dir(config: TrainConfig) -> Path:
    return config.out / "checkpoints"


def check_out(config: TrainConfig) -> None:
    """UserError unless OUT can take the run: a writable folder; holding no other run's files
    unless --resume or --overwrite; a checkpoint to continue with --resume (of its STEP if given)."""
    try:
        check_writable_folder(config.out)
    except ValueError as error:
        raise UserError(f"--out {error}") from None
    try:
        existing = checkpoint.newest(checkpoint_dir(config))
    except CheckpointError as error:
        if not config.overwrite:
            raise UserError(str(error)) from None
        existing = None
    held = run_files(config.out)
    if held and not (config.resume or config.overwrite):
        if existing is not None:
            raise UserError(
                f"{config.out} holds a run with a checkpoint (step {existing['step']}): pass --resume to "
                "continue it or --overwrite to replace it"
            )
        raise UserError(
            f"{config.out} holds another run's {', '.join(held)}: pass --overwrite to replace it, or another --out"
        )
    if config.resume and existing is None:
        aside = set_aside_runs(config.out)
        hint = f" (the run --overwrite replaced is in {aside[-1]}: move its files back to continue it)" if aside else ""
        raise UserError(f"--resume: {checkpoint_dir(config)} holds no checkpoint to continue{hint}")
    kept = checkpoint.steps(checkpoint_dir(config)) if config.resume not in (None, NEWEST) else []
    if kept and config.resume not in kept:
        raise UserError(
            f"--resume {config.resume}: {checkpoint_dir(config)} holds no checkpoint of step {config.resume} "
            f"(it keeps steps {', '.join(map(str, kept))}; --keep-checkpoints sets how many)"
        )


def after_interrupt(config: TrainConfig) -> str:
    """What a run stopped by Ctrl-C leaves in OUT, and how to go on from it (one sentence)."""
    try:
        newest = checkpoint.newest(checkpoint_dir(config))
    except CheckpointError as error:
        return f"interrupted; {error}"
    if newest is not None:
        return f"interrupted; --resume (without --overwrite) continues from the checkpoint of step {newest['step']}"
    aside = set_aside_runs(config.out)
    if aside:  # --overwrite moved the old run there, and deletes it at the new run's first checkpoint
        return (
            f"interrupted before its first checkpoint; the run it replaces is in {aside[-1]} (move its files "
            "back to keep it): the same command starts again, and deletes it once it saves a checkpoint"
        )
    if config.checkpoint_every == 0:
        return "interrupted; with --checkpoint-every 0 it saved no checkpoint: --overwrite starts it again"
    return (
        f"interrupted before its first checkpoint (--checkpoint-every {config.checkpoint_every}): --overwrite "
        "starts it again"
    )


def after_non_finite(config: TrainConfig) -> str:
    """What a run stopped by a non-finite loss, gradient norm or state leaves in OUT, and how to go
    on from it (the end of a sentence)."""
    try:
        newest = checkpoint.newest(checkpoint_dir(config))
    except CheckpointError as error:
        return str(error)
    if newest is None:
        aside = set_aside_runs(config.out)
        kept = f" (the run it replaces is in {aside[-1]}: move its files back to keep it)" if aside else ""
        return f"it saved no checkpoint{kept}: --overwrite starts it again, with {_remedies(config, [])}"
    # a resumed run names each field of the run's record it changes
    overrides = ["(and --override lr)", "(and --override grad_clip)"]
    return (
        f"the newest checkpoint, of step {newest['step']}, is the last finite state: --resume continues from "
        f"it, with {_remedies(config, overrides)}"
    )


def _remedies(config: TrainConfig, overrides: list[str]) -> str:
    """'a lower --lr, a --grad-clip or --skip-non-finite', each change followed by its override."""
    changes = [" ".join([change, *overrides[i : i + 1]]) for i, change in enumerate(("a lower --lr", "a --grad-clip"))]
    if not config.skip_non_finite:
        changes.append("--skip-non-finite")
    return f"{', '.join(changes[:-1])} or {changes[-1]}"


def after_stop_signal(config: TrainConfig, step: int, saved: bool) -> str:
    """What a run stopped by SIGTERM after ``step`` leaves in OUT, and how to go on (one sentence)."""
    if not saved:  # --checkpoint-every 0
        return f"stopped by SIGTERM after step {step}; with --checkpoint-every 0 it saved no checkpoint"
    if config.resume:
        how = "the same command (with --resume) continues it"
    elif config.overwrite:
        how = "the same command with --resume in place of --overwrite continues it"
    else:
        how = "the same command with --resume continues it"
    return f"stopped by SIGTERM after step {step} and saved its checkpoint in {checkpoint_dir(config)}: {how}"


def non_finite_state(model, optimizer) -> str | None:
    """Where the parameters or the optimizer state hold an inf or nan, for the message (None: all
    finite), the same on every rank (a collective where torch.distributed runs). Each rank reads its
    own tensors on their device (fsdp's and --shard-optimizer's shards, else a replica): one pass
    over the weights and the optimizer state, and a wait for the device, per checkpoint."""
    model = getattr(model, "module", model)
    inner = optimizer.local if isinstance(optimizer, ShardedOptimizer) else optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    places, tensors = [], []
    for name, param in model.named_parameters():
        places.append(f"parameter {name}")
        tensors.append(param)
    for param, state in inner.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                places.append(f"the optimizer's {key} of {names.get(id(param), 'a parameter')}")
                tensors.append(value)
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensor shards
    finite = torch.stack([t.isfinite().all() for t in local]).tolist() if local else []
    found = next((place for place, ok in zip(places, finite, strict=True) if not ok), None)
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, found)
        found = next((place for place in every if place is not None), None)
    return found


def training_state(model, optimizer, config: TrainConfig) -> dict:
    """{"model", "optimizer"} state dicts in the layout of an unsharded single-process run, gathered
    as the --parallel mode holds them (`ParallelMode.training_state`)."""
    model_state, optimizer_state = parallel_mode(config.parallel_spec()).training_state(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def restore(state: dict, model, optimizer, config: TrainConfig) -> None:
    """Load a `training_state` dict (the learning rate is set by the schedule before every step)."""
    parallel_mode(config.parallel_spec()).restore(model, optimizer, state["model"], state["optimizer"])


def save_checkpoint(
    config: TrainConfig, step: int, position: int, run: str, record: dict, model, optimizer, rank: int, log: TrainLog
) -> None:
    """Every rank takes part (sharded states are gathered); rank 0 writes; if that fails, every rank
    raises its error rather than waiting for rank 0. ``record``: the run's `TrainConfig.run_record`.
    A state that holds an inf or nan is never written: every rank raises NonFiniteError instead
    (`non_finite_state`; the loop checks the loss and gradient norm before, this the update's result)."""
    place = non_finite_state(model, optimizer)
    if place is not None:
        raise NonFiniteError(f"after step {step} {place} holds an inf or nan, so its checkpoint was not saved")
    state = {**training_state(model, optimizer, config), "data": {"position": position}, "run_id": run}
    failure = None
    if rank == 0:
        try:
            path = checkpoint.save(checkpoint_dir(config), step, record, state, keep=config.keep_checkpoints)
            log.note(f"checkpoint step {step}: {path}")
        except CheckpointError as error:
            failure = str(error)
    if dist.is_initialized():
        shared = [failure]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0]
    if failure is not None:
        raise CheckpointError(failure)


# What sets the run record's fields that no option --<field> sets
RECORD_SOURCES = {
    "context_length": "--context",
    "num_layers": "--layers",
    "num_heads": "--heads",
    "vocab_size": "the data's vocabulary",
    "tokenizer": "the data's tokenizer",
    "norm_eps": "--preset",
    "rope_theta": "--preset",
}


def load_for_resume(config: TrainConfig, record: dict) -> checkpoint.Checkpoint:
    """The checkpoint --resume names, checked against the run's record and OUT's log: UserError for
    options that do not fit it (fixed by changing them or by --override), CheckpointError for a
    checkpoint that cannot be used (damaged, unreadable)."""
    newest = checkpoint.newest(checkpoint_dir(config))  # checked first: no --override makes this change possible
    saved = newest["config"].get("precision") if newest else None
    if saved not in (None, config.precision) and stores_bf16_weights(saved) != stores_bf16_weights(config.precision):
        raise UserError(
            f"{checkpoint_dir(config)} holds a checkpoint of precision {saved}; a run cannot change "
            f"to or from bf16-weights (the optimizer state then holds fp32 masters and one more "
            f"param group)"
        )
    try:
        resumed = checkpoint.load(
            checkpoint_dir(config),
            record,
            config.override,
            step=None if config.resume == NEWEST else config.resume,
            implied=IMPLIED_BY_OLDER_RUNS,
        )
    except DamagedCheckpointError as error:
        hint = f"; pass --resume {error.intact_step} to continue from it" if error.intact_step is not None else ""
        raise CheckpointError(f"{error}{hint}") from None
    except ConfigMismatchError as error:
        fixed = [f for f in error.fields if f not in OVERRIDABLE]
        if fixed:
            named = ", ".join(f"{f} ({RECORD_SOURCES.get(f, flag(f))})" for f in fixed)
            raise UserError(f"{error}; {named} cannot change when resuming") from None
        flags = " ".join(f"--override {f}" for f in error.fields)
        raise UserError(f"{error}; pass {flags} to continue with the change") from None
    if resumed.step > config.steps:
        raise UserError(f"{checkpoint_dir(config)} is at step {resumed.step}, past --steps {config.steps}")
    logged, saved = run_id(config.out), resumed.state.get("run_id")  # older versions' checkpoints hold none
    if None not in (logged, saved) and logged != saved:
        raise UserError(
            f"{config.out / 'run.json'} and log.jsonl belong to another run than the checkpoints in "
            f"{checkpoint_dir(config)}: move them away to resume"
        )
    return resumed
