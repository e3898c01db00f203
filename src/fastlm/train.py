"""`fastlm train`: train the language model on prepared token data, on one process or one per GPU.

`python -m fastlm.train` is the same command, the module torchrun starts once per GPU:

    python -m fastlm.data prepare --input notes.txt --tokenizer bytes --out data/notes
    python -m fastlm.train --data data/notes --preset tiny --context 128 --steps 300 --out runs/notes
    torchrun --nproc-per-node 2 -m fastlm.train --data data/owt --preset small --context 2048 --parallel fsdp

A step trains on a global batch of --batch-tokens tokens: --batch-tokens / --context windows (see
`fastlm.data.tokens`), taken at the run's data position. Each of the P processes takes its
contiguous share and runs it as A micro-batches of --micro-batch windows (gradient accumulation,
A = --batch-tokens / (--context x --micro-batch x P)); the gradient is the mean over the global
batch whatever P and A are, so 1, 2 or 4 processes train the same curve up to rounding. Then the
global gradient norm is clipped to --grad-clip and AdamW (betas 0.9, 0.95; weight decay on
matrices and embeddings only) steps with the learning rate of `fastlm.optim.schedule` (linear
warmup, cosine decay to --min-lr-ratio x --lr over --steps). The model's vocabulary is the data's
rounded up to a multiple of 64 (tensor-core-friendly shapes; the extra ids never occur).
`--precision bf16` runs the forward under bf16 autocast over fp32 weights; `bf16-weights` stores
the matmul weights in bf16 with their fp32 masters in `fastlm.optim.AdamW` (no step casts a weight
or its gradient; the forward sees the same bf16 values either way).

`--parallel`: none (one process), naive / flat (`allreduce_gradients` after backward, per parameter
/ flattened), ddp / bucketed (fastlm's overlapping wrappers), torch-ddp (PyTorch's
DistributedDataParallel), fsdp (PyTorch's FSDP2 `fully_shard` per block and the root: parameters,
gradients and optimizer state sharded). `--shard-optimizer` wraps AdamW in `ShardedOptimizer`.
Micro-batches before the last skip the gradient synchronization. `--compile compile` compiles the
model (each block under fsdp), `cudagraphs` also replays it as CUDA graphs (one process, no
accumulation: a graph's gradients are overwritten by its next replay).

Host synchronization happens only at log intervals (--log-every, evaluations, checkpoints): the
losses and gradient norms stay on the device until then, and the next micro-batch is copied while
the current one computes. `fastlm.train_log` describes the log lines, OUT/log.jsonl and
OUT/loss.png; OUT/run.json records the configuration and the machine.

Checkpoints (OUT/checkpoints, see `fastlm.checkpoint`), every --checkpoint-every steps and after the
last: every rank takes part in gathering the state, rank 0 writes, verifies and commits it, keeping
the last --keep-checkpoints; a process killed at any moment leaves the committed ones whole. A
checkpoint holds the model, the optimizer and the data position (windows consumed), and records the
run's configuration; `--resume` continues exactly (the same tokens, bit for bit on the same
machine and world size) and refuses a run that differs unless each change is named with
`--override FIELD`. A folder that holds checkpoints is only continued (--resume) or replaced
(--overwrite). Mistakes in the arguments end in a one-line error (status 2), unusable checkpoints
too (status 1), on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from fastlm import checkpoint
from fastlm.checkpoint import CheckpointError
from fastlm.data.prepare import DataError
from fastlm.data.tokens import EpochOrder, TokenData, Windows
from fastlm.devices import current_device_name
from fastlm.distributed import ShardedOptimizer
from fastlm.distributed.launch import exit_process
from fastlm.distributed.wrappers import BUCKETED_MODES, ParallelSpec, Wrapped, wrap
from fastlm.harness.steps import autocasts
from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.transformer import linear_weights
from fastlm.optim import AdamW
from fastlm.optim.schedule import warmup_cosine_lr
from fastlm.train_checkpoint import checkpoint_dir, load_for_resume, restore, save_checkpoint
from fastlm.train_log import Throughput, TrainLog, loss_plot, read_log
from fastlm.train_options import MAX_SEED, UsageError, add_arguments

VOCAB_MULTIPLE = 64
BETAS = (0.9, 0.95)
# ModelConfig's field -> the option that sets it, for its error messages
MODEL_OPTIONS = {"d_model": "--d-model", "d_ff": "--d-ff", "num_layers": "--layers", "num_heads": "--heads",
                 "context_length": "--context"}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Arguments and configuration
# ---------------------------------------------------------------------------------------------


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """A copy with the device-dependent defaults filled in (preset, precision, compile)."""
    gpu = torch.cuda.is_available()
    defaults = {"preset": "small" if gpu else "tiny", "precision": "bf16" if gpu else "fp32",
                "compile": "compile" if gpu else "eager"}  # fmt: skip
    return argparse.Namespace(**{**vars(args), **{k: getattr(args, k) or v for k, v in defaults.items()}})


def check_arguments(args: argparse.Namespace, world: int) -> None:
    """Raise UsageError, naming the option, for values out of range and options that do not combine."""
    for name in ("context", "micro_batch", "steps", "keep_checkpoints", "log_every", "eval_sequences"):
        if getattr(args, name) < 1:
            raise UsageError(f"{_flag(name)} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "eval_every", "checkpoint_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"{_flag(name)} must be 0 or more, got {getattr(args, name)}")
    for name in ("lr", "bucket_mb", "timeout_s"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise UsageError(f"{_flag(name)} must be a positive number, got {getattr(args, name)}")
    for name in ("weight_decay", "grad_clip"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise UsageError(f"{_flag(name)} must be 0 or a positive number, got {getattr(args, name)}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be between 0 and 1, got {args.min_lr_ratio}")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be between 0 and {MAX_SEED}, got {args.seed}")
    try:
        model_config(args, vocab_size=1)
    except ValueError as error:
        message = str(error)
        for field, option in MODEL_OPTIONS.items():
            message = message.replace(field, option)
        raise UsageError(message) from None
    per_micro_step = args.context * args.micro_batch * world
    if args.batch_tokens is not None and (args.batch_tokens < 1 or args.batch_tokens % per_micro_step):
        raise UsageError(f"--batch-tokens must be a positive multiple of --context x --micro-batch x processes = "
                         f"{args.context} x {args.micro_batch} x {world} = {per_micro_step}, "
                         f"got {args.batch_tokens}")  # fmt: skip
    if args.compile == "cudagraphs" and (args.parallel != "none" or accumulation(args, world) > 1):
        raise UsageError("--compile cudagraphs needs --parallel none and no gradient accumulation (--batch-tokens "
                         "= --context x --micro-batch): a graph's gradients are overwritten by its next "
                         "replay")  # fmt: skip
    if args.precision == "bf16-weights" and (args.parallel == "fsdp" or args.shard_optimizer):
        raise UsageError("--precision bf16-weights does not combine with --parallel fsdp or --shard-optimizer (they "
                         "shard the optimizer state, which would have to hold the fp32 masters)")  # fmt: skip
    if args.parallel == "fsdp" and args.shard_optimizer:
        raise UsageError("--shard-optimizer does not combine with --parallel fsdp (FSDP already shards the "
                         "optimizer state)")  # fmt: skip
    if args.override and not args.resume:
        raise UsageError("--override needs --resume")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: continue the checkpoint's run, or replace it")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file, not a folder")
    try:
        existing = checkpoint.newest(checkpoint_dir(args))
    except CheckpointError as error:
        if not args.overwrite:
            raise UsageError(str(error)) from None
        existing = None
    if existing is not None and not (args.resume or args.overwrite):
        raise UsageError(f"{checkpoint_dir(args)} holds a checkpoint (step {existing['step']}): pass --resume to "
                         "continue its run or --overwrite to replace it")  # fmt: skip
    if args.resume and existing is None:
        raise UsageError(f"--resume: {checkpoint_dir(args)} holds no checkpoint to continue")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def batch_tokens(args: argparse.Namespace, world: int) -> int:
    return args.batch_tokens or args.context * args.micro_batch * world


def accumulation(args: argparse.Namespace, world: int) -> int:
    """Micro-batches per process per step."""
    return batch_tokens(args, world) // (args.context * args.micro_batch * world)


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The preset with any dimension given and the kernels chosen; the data's vocabulary rounded up."""
    dims = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.layers, "num_heads": args.heads}
    padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = ModelConfig.preset(args.preset, vocab_size=padded, context_length=args.context,
                                **{k: v for k, v in dims.items() if v is not None})  # fmt: skip
    return config.with_kernels(args.kernels)


def run_config(args: argparse.Namespace, world: int, data: TokenData) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint to continue it exactly."""
    dims = dataclasses.asdict(model_config(args, data.vocab_size))
    for switch in ("attention", "norm", "rope", "loss", "softmax"):  # the kernels field says which
        del dims[switch]
    return {"data": data.sha256[:16], "tokenizer": data.tokenizer, "preset": args.preset, **dims,
            "batch_tokens": batch_tokens(args, world), "micro_batch": args.micro_batch, "precision": args.precision,
            "kernels": args.kernels, "compile": args.compile, "seed": args.seed, "lr": args.lr,
            "min_lr_ratio": args.min_lr_ratio, "warmup": args.warmup, "steps": args.steps,
            "weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "parallel": args.parallel,
            "world_size": world}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Processes, wrapping, data
# ---------------------------------------------------------------------------------------------


def _rank_and_world(args) -> tuple[int, int]:
    if args.parallel == "none":
        return 0, 1
    if "RANK" not in os.environ:
        raise UsageError(f"--parallel {args.parallel} needs torchrun (RANK / WORLD_SIZE are not set)")
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


def _wrap(model: torch.nn.Module, args, device: torch.device) -> Wrapped:
    """The model wrapped for --parallel (the registry of `fastlm.distributed.wrappers`)."""
    bucket_mb = args.bucket_mb if args.parallel in BUCKETED_MODES else None
    return wrap(model, ParallelSpec(args.parallel, bucket_mb), device)


def _gradient_sync(model: torch.nn.Module, args, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a micro-batch's backward: without ``sync``, gradients accumulate locally."""
    if args.parallel == "fsdp":
        model.set_requires_gradient_sync(sync)
    elif not sync and args.parallel in ("ddp", "bucketed", "torch-ddp"):
        return model.no_sync()
    return contextlib.nullcontext()


def _compile(model: TransformerLM, args) -> None:
    """Compile in place (state-dict keys stay those of the eager model): each block under fsdp,
    before sharding (the graphs stop at FSDP's hooks between blocks), else the whole model."""
    if args.compile == "eager":
        return
    mode = {"compile": "default", "cudagraphs": "reduce-overhead"}[args.compile]
    for module in model.blocks if args.parallel == "fsdp" else [model]:
        module.compile(mode=mode)


def _optimizer(model: torch.nn.Module, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings (2-d), none on norm weights. PyTorch's (fused
    on CUDA); for bf16-weights fastlm's, whose first group stores the matmul weights in bf16 from
    here on, with their fp32 masters in its state."""
    params = list(model.parameters())
    if args.precision == "bf16-weights":
        low = linear_weights(model)
        low_ids = {id(p) for p in low}
        groups = [{"params": low, "weight_decay": args.weight_decay, "param_dtype": torch.bfloat16},
                  {"params": [p for p in params if p.dim() >= 2 and id(p) not in low_ids],
                   "weight_decay": args.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        return AdamW([g for g in groups if g["params"]], lr=args.lr, betas=BETAS)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    options = {"lr": args.lr, "betas": BETAS, "fused": device.type == "cuda"}
    if args.shard_optimizer:
        return ShardedOptimizer(groups, torch.optim.AdamW, **options)
    return torch.optim.AdamW(groups, **options)


def _clip_gradients(model: torch.nn.Module, args) -> torch.Tensor:
    """Scale the gradients to a global norm of at most --grad-clip (0: no limit); the norm before.
    bf16-weights: every gradient's norm summed in fp32 (PyTorch's clip_grad_norm_ returns a bf16
    gradient's norm in bf16, 0.1% off, and clips by that)."""
    max_norm = args.grad_clip or math.inf
    if args.precision != "bf16-weights":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}  # one multi-tensor launch per dtype, as PyTorch's
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    norms = [n for grads in by_dtype.values() for n in torch._foreach_norm(grads, 2.0, dtype=torch.float32)]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def micro_batches(
    windows: Windows,
    order: EpochOrder,
    position: int,
    micro_batch: int,
    accumulation: int,
    rank: int,
    world: int,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (tokens, targets) micro-batches, (micro_batch, context) each, step after step
    from data position ``position``: of a step's global batch (positions [p, p + G), G = micro_batch
    x accumulation x world) rank r takes the contiguous share [p + r G / world, p + (r + 1) G / world)."""
    share = micro_batch * accumulation
    while True:
        for index in range(accumulation):
            rows = torch.from_numpy(windows[order.ids(position + rank * share + index * micro_batch, micro_batch)])
            if device.type == "cuda":
                rows = rows.pin_memory()  # so the copy below is asynchronous
            rows = rows.to(device, non_blocking=True)
            yield rows[:, :-1], rows[:, 1:]
        position += share * world


def evaluation_windows(windows: Windows, args, world: int) -> int:
    """How many held-out windows an evaluation takes: --eval-sequences, or as many as the split has,
    rounded down to a multiple of --micro-batch x processes (every rank runs the same forwards)."""
    unit = args.micro_batch * world
    if args.eval_sequences < unit:
        raise UsageError(f"--eval-sequences must be at least --micro-batch x processes = {unit}, got "
                         f"{args.eval_sequences}")  # fmt: skip
    count = min(args.eval_sequences, windows.count) // unit * unit
    if count == 0:
        raise UsageError(f"the held-out split of {args.data} holds {windows.count} window(s) of --context + 1 = "
                         f"{args.context + 1} tokens, fewer than --micro-batch x processes = {unit}; use a smaller "
                         "--context or --micro-batch, or prepare the data with a larger --held-out")  # fmt: skip
    return count


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: Windows, count: int, args, rank: int, world: int,
             device: torch.device, autocast) -> float:  # fmt: skip
    """Mean loss of the first ``count`` held-out windows; each rank takes its contiguous share."""
    share = count // world
    total = torch.zeros((), device=device)
    for first in range(rank * share, (rank + 1) * share, args.micro_batch):
        rows = torch.from_numpy(windows[np.arange(first, first + args.micro_batch)]).to(device)
        if args.compile == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            total += model(rows[:, :-1], rows[:, 1:]).float() * args.micro_batch
    if world > 1:
        dist.all_reduce(total)
    return total.item() / count


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict:
    """Run the training loop (``args`` with `resolve_defaults` applied and checked); returns
    {"step", "losses" (per step of this run, mean over ranks), "eval" ([step, loss] pairs),
    "tokens_per_s", "mfu" (medians of the log intervals after the first; None before any),
    "peak_memory_gib"} on every rank. Raises UsageError, DataError and CheckpointError with one-sentence messages."""
    rank, world = _rank_and_world(args)
    data = TokenData(args.data)
    train_windows, held_out = Windows(data.split("train"), args.context), Windows(data.split("val"), args.context)
    if train_windows.count == 0:
        raise UsageError(f"the training split of {args.data} holds no window of --context + 1 = {args.context + 1} "
                         "tokens; use a smaller --context or more text")  # fmt: skip
    eval_count = evaluation_windows(held_out, args, world)
    config = run_config(args, world, data)
    # verified before the process group exists, so a bad checkpoint stops every rank with its message
    resumed = load_for_resume(args, config) if args.resume else None
    if resumed is not None and resumed.step == args.steps:
        if rank == 0:
            print(f"{checkpoint_dir(args)} is at step {resumed.step} of {args.steps}: nothing to train", flush=True)
        return {"step": resumed.step, "losses": [], "eval": [], "tokens_per_s": None, "mfu": None,
                "peak_memory_gib": None}  # fmt: skip
    device = _setup(args)
    try:
        # The loop's model, wrapper and optimizer are freed when it returns, while the process group
        # is still registered. Freed after destroy_process_group, PyTorch DDP's reducer would drop the
        # group's last reference, and the group's destructor joins gloo threads that wait for the GIL
        # the freeing thread holds: a hang at exit.
        pending = [resumed]  # handed over, so the loop can free the loaded tensors once restored
        del resumed
        return _train_loop(args, config, pending, rank, world, device, (train_windows, held_out, eval_count))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_loop(args, config: dict, pending: list, rank: int, world: int, device: torch.device, data) -> dict:
    """The steps; ``pending`` holds the checkpoint to resume from (or None), taken out here."""
    train_windows, held_out, eval_count = data
    resumed = pending.pop()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model_cfg = model_config(args, config["vocab_size"])
    model = TransformerLM(model_cfg).to(device)
    # bf16-weights: the optimizer stores the matmul weights in bf16, before a wrapper sizes its
    # gradient buckets by the parameters' dtypes; the other precisions build it after wrapping (FSDP
    # replaces the parameters)
    optimizer = _optimizer(model, args, device) if args.precision == "bf16-weights" else None
    if args.parallel == "fsdp":
        _compile(model, args)
    wrapped = _wrap(model, args, device)
    model = wrapped.module
    if args.parallel != "fsdp":
        _compile(model, args)
    if optimizer is None:
        optimizer = _optimizer(model, args, device)
    step, position = 0, 0
    if resumed is not None:
        restore(resumed.state, model, optimizer, args)
        step, position = resumed.step, resumed.state["data"]["position"]
        resumed = None  # drop the loaded tensors: the model holds them now
    start_new = not args.resume  # the first save of a new run replaces the folder's older checkpoints
    accumulate = accumulation(args, world)
    tokens_per_step = batch_tokens(args, world)
    batches = micro_batches(train_windows, EpochOrder(train_windows.count, args.seed), position, args.micro_batch,
                            accumulate, rank, world, device)  # fmt: skip
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocasts(args.precision))
    meter = Throughput(model_cfg, args, world, device)
    log = TrainLog(args.out / "log.jsonl", args.steps, step, enabled=rank == 0)
    if rank == 0:
        _write_run_file(args, config, model_cfg, world, device)  # the end rewrites it with the result
    result = {"losses": [], "eval": []}
    with log:
        log.note(_describe(args, model_cfg, world, accumulate, tokens_per_step, position, train_windows.count))
        if step == 0:
            loss = evaluate(model, held_out, eval_count, args, rank, world, device, autocast)
            log.write({"step": 0, "eval_loss": loss})
            result["eval"].append([0, loss])
        pending_losses, pending_norms = [], []
        batch = next(batches)
        meter.start()
        while step < args.steps:
            lr = warmup_cosine_lr(step, lr=args.lr, min_lr=args.lr * args.min_lr_ratio, warmup=args.warmup,
                                  steps=args.steps)  # fmt: skip
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = None
            for index in range(accumulate):
                with _gradient_sync(model, args, sync=index == accumulate - 1):
                    if args.compile == "cudagraphs":
                        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
                    with autocast:
                        loss = model(*batch)
                    batch = next(batches)  # its copy overlaps this micro-batch's backward
                    (loss / accumulate).backward()
                # a new tensor, not the graph output that the next replay of a CUDA graph overwrites
                step_loss = loss.detach() / accumulate if step_loss is None else step_loss + loss.detach() / accumulate
            wrapped.synchronize()  # the wrappers that average after backward do it here
            norm = _clip_gradients(model, args)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            position += tokens_per_step // args.context
            pending_losses.append(step_loss)
            pending_norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under fsdp
            log.advance()
            last = step == args.steps
            evaluating = last or (args.eval_every and step % args.eval_every == 0)
            saving = args.checkpoint_every and (last or step % args.checkpoint_every == 0)
            if not (evaluating or saving or step % args.log_every == 0):
                continue
            losses = torch.stack(pending_losses).float()
            if world > 1:
                dist.all_reduce(losses)
                losses /= world
            losses = losses.tolist()  # the host waits for the device here, once per log interval
            record = {"step": step, "loss": sum(losses) / len(losses), "lr": lr,
                      "grad_norm": pending_norms[-1].item(), "tokens": step * tokens_per_step,
                      **meter.interval(len(losses) * tokens_per_step)}  # fmt: skip
            result["losses"] += losses
            pending_losses, pending_norms = [], []
            if evaluating:
                record["eval_loss"] = evaluate(model, held_out, eval_count, args, rank, world, device, autocast)
                result["eval"].append([step, record["eval_loss"]])
            log.write(record)
            if saving:
                save_checkpoint(args, step, position, config, model, optimizer, rank, start_new, log)
                start_new = False
            meter.start()  # evaluations and checkpoints are not training time
    result = {"step": step, **result, **meter.steady_state()}
    if rank == 0:
        _plot(args, model_cfg, world)
        _write_run_file(args, config, model_cfg, world, device, result)
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while another still has collectives in flight
    return result


def _describe(args, model_cfg: ModelConfig, world: int, accumulate: int, tokens_per_step: int, position: int,
              windows: int) -> str:  # fmt: skip
    parameters = model_cfg.num_parameters()
    return (f"training {args.preset} ({parameters / 1e6:.1f}M parameters, {args.kernels} kernels, {args.precision}, "
            f"{args.compile}) on {world} process(es), --parallel {args.parallel}: {tokens_per_step:,} tokens per "
            f"step = {world} x {accumulate} micro-batch(es) of {args.micro_batch} x {args.context}; "
            f"{windows:,} training windows, data position {position:,}")  # fmt: skip


def _write_run_file(args, config: dict, model_cfg: ModelConfig, world: int, device: torch.device,
                    result: dict | None = None) -> None:  # fmt: skip
    """OUT/run.json: the configuration, the model's size and where the run ran; at the end also
    what `train` returns (the per-step losses, the evaluations, steady-state tokens/s and MFU)."""
    from fastlm.harness.records import with_environment

    args.out.mkdir(parents=True, exist_ok=True)
    run = with_environment({"config": config, "parameters": model_cfg.num_parameters(), "world_size": world,
                            "device": str(device), "argv": sys.argv, "result": result})  # fmt: skip
    (args.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")


def _plot(args, model_cfg: ModelConfig, world: int) -> None:
    records = read_log(args.out / "log.jsonl")
    title = (f"{args.preset} ({model_cfg.num_parameters() / 1e6:.1f}M) on {args.data.name}, context {args.context}, "
             f"{batch_tokens(args, world):,} tokens per step, {world} process(es) · "
             f"{current_device_name()}")  # fmt: skip
    loss_plot(args.out / "loss.png", {"": records}, title)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`fastlm train`; 0 when done, 2 after a one-line error for a mistake in the arguments or data
    that does not fit them, 1 for an unusable checkpoint. Prints on every rank."""
    args = resolve_defaults(args)
    try:
        check_arguments(args, _rank_and_world(args)[1])
        train(args)
    except (UsageError, DataError) as error:
        print(f"{args.prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
    except CheckpointError as error:
        print(f"{args.prog}: error: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fastlm.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process
