"""The training loop of `fastlm train`: the language model on prepared token data, on one process or
one per GPU, as a `fastlm.train.config.TrainConfig` says.

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
DistributedDataParallel), fsdp (PyTorch's FSDP2 `fully_shard` on units of blocks and the root:
parameters, gradients and optimizer state sharded; clipping and AdamW work on the local shards,
`fastlm.distributed.local_shards`); `--reduce-dtype bf16` averages the gradients in
bf16. `--shard-optimizer` wraps AdamW in `ShardedOptimizer`. `--recompute` checkpoints activations.
Micro-batches before the last skip the gradient synchronization. `--compile compile` compiles the
model (under fsdp the blocks as one graph when they are one unit, else each block), `cudagraphs`
also replays it as CUDA graphs (one process, no accumulation: a graph's gradients are overwritten
by its next replay).

Host synchronization happens only at log intervals (--log-every, evaluations, checkpoints): the
losses and gradient norms stay on the device until then, and the next micro-batch is copied while
the current one computes. There the loop also checks them: a loss or gradient norm that is not
finite (inf, nan) stops the run (`NonFiniteError`, one line naming the first such step, status 1)
before anything of it is saved, and a checkpoint is saved only of a finite state
(`fastlm.train.checkpoint.non_finite_state`), so the newest checkpoint stays the last finite one.
`--skip-non-finite N` checks every step instead, at the price of a host wait per step, and drops
such a step's update, stopping after N in a row. SIGTERM (what schedulers and torchrun send before
a kill) ends the run after the step in progress with a checkpoint of it (status 143); under
torchrun, where the ranks must stop at the same step, after the step that follows: the ranks agree
on it through a few bytes all-reduced between the hosts while that step runs (`_Agreement`).

`fastlm.train.log` describes the log lines, OUT/log.jsonl and OUT/loss.png; OUT/run.json records
the configuration and the machine.

Checkpoints (OUT/checkpoints, see `fastlm.checkpoint`), every --checkpoint-every steps and after the
last: every rank takes part in gathering the state, rank 0 writes, verifies and commits it, keeping
the last --keep-checkpoints; a process killed at any moment leaves the committed ones whole. A
checkpoint holds the model, the optimizer, the data position (windows consumed) and the run's id
(OUT/run.json records it too), and records the run's configuration; `--resume` continues exactly
(the same tokens, bit for bit on the same machine and world size), cutting the log back to the
checkpoint's step, and refuses a run that differs unless each change is named with `--override
FIELD`; `--resume STEP` continues from an older kept checkpoint (when the newest is damaged, the
error names the intact one). A folder that holds a run is only continued (--resume) or replaced
(--overwrite, which keeps the old run aside until the new one has a checkpoint: `fastlm.train.log`).
Mistakes in the arguments, --out included, end in a one-line error (status 2) before any work,
unusable checkpoints too (status 1), on every rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from fastlm.checkpoint import CheckpointError
from fastlm.data.documents import cu_seqlens
from fastlm.data.tokens import EpochOrder, TokenData, Windows
from fastlm.devices import current_device_name
from fastlm.distributed.wrappers import ParallelMode, parallel_mode
from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.materialize import materialize
from fastlm.model.precision import convert_for, param_groups, precision_context
from fastlm.model.transformer import RouterTotals
from fastlm.optim import AdamW
from fastlm.optim.schedule import warmup_cosine_lr
from fastlm.settings import CUDAGRAPHS_NEED_A_GPU, TORCH_COMPILE_MODE, autocasts, stores_bf16_weights
from fastlm.train.checkpoint import (
    NonFiniteError,
    after_interrupt,
    after_non_finite,
    after_stop_signal,
    check_out,
    checkpoint_dir,
    load_for_resume,
    restore,
    save_checkpoint,
)
from fastlm.train.config import TrainConfig, add_arguments
from fastlm.train.log import (
    Throughput,
    TrainLog,
    discard_set_aside,
    expert_load_plot,
    loss_plot,
    new_run_id,
    read_log,
    set_aside,
)
from fastlm.train.memory_fit import check_state_fits_device, out_of_memory_message
from fastlm.utils.errors import UserError, is_out_of_memory, report_error
from fastlm.utils.options import from_namespace
from fastlm.utils.parser import Parser
from fastlm.utils.records import with_environment

PROG = "python -m fastlm.train"
SIGTERM_STATUS = 128 + signal.SIGTERM  # 143: the shell's status of a process ended by SIGTERM
BETAS = (0.9, 0.95)
CPU_FASTLM_KERNELS = (
    "no GPU: --kernels fastlm runs the ops' plain-PyTorch reference paths (under TRITON_INTERPRET=1 the "
    "Triton interpreter), slower than --kernels torch here; the fused kernels need a GPU"
)


# ---------------------------------------------------------------------------------------------
# Processes, wrapping, data
# ---------------------------------------------------------------------------------------------


def _rank_and_world(config: TrainConfig) -> tuple[int, int]:
    if not config.parallelism.processes:
        processes = int(os.environ.get("WORLD_SIZE", 1))
        if processes > 1:  # each would train the whole run alone, into the same --out
            raise UserError(
                f"torchrun started {processes} processes but --parallel is {config.parallel}: pass --parallel ddp, "
                "fsdp or another mode of --help, or run one process without torchrun"
            )
        return 0, 1
    if "RANK" not in os.environ:
        raise UserError(f"--parallel {config.parallel} needs torchrun (RANK / WORLD_SIZE are not set)")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _setup(config: TrainConfig) -> torch.device:
    """The device of this rank; initializes torch.distributed unless --parallel none."""
    if not config.parallelism.processes:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s))
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _parallel_mode(config: TrainConfig) -> ParallelMode:
    """The --parallel mode's object (`fastlm.distributed.wrappers`), which holds every step of the
    run that depends on the mode."""
    return parallel_mode(config.parallel_spec())


def _compute_dtype(config: TrainConfig) -> torch.dtype | None:
    """The forward's autocast dtype, in which fsdp all-gathers the blocks' weights; None: no autocast."""
    return torch.bfloat16 if autocasts(config.precision) else None


def _materialize(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> None:
    """The meta-device model's weights on ``device``, the same on every rank and in every parallel
    mode (`fastlm.model.materialize`: sharded ones are initialized whole, one at a time)."""
    torch.manual_seed(config.seed)
    materialize(model, device)


def _compile(model: TransformerLM, config: TrainConfig) -> None:
    """Compile in place for --compile (eager: nothing), what the --parallel mode compiles
    (`ParallelMode.compile`: the whole model, or under fsdp its blocks)."""
    if config.compile == "eager":
        return
    _parallel_mode(config).compile(model, TORCH_COMPILE_MODE[config.compile], _compute_dtype(config))


def _optimizer(model: torch.nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `fastlm.model.precision.param_groups`: for bf16-weights fastlm's, whose first group
    stores the matmul weights in bf16 from here on, with their fp32 masters in its state (it does
    not combine with a sharded optimizer state: `TrainConfig.check`); otherwise the --parallel
    mode's (`ParallelMode.optimizer`: PyTorch's, fused on CUDA, sharded or on fsdp's local shards)."""
    groups = param_groups(model, config.precision, config.weight_decay)
    if stores_bf16_weights(config.precision):
        return AdamW(groups, lr=config.lr, betas=BETAS)
    return _parallel_mode(config).optimizer(groups, lr=config.lr, betas=BETAS, fused=device.type == "cuda")


def _clip_gradients(model: torch.nn.Module, config: TrainConfig) -> torch.Tensor:
    """Scale the gradients to a global norm of at most --grad-clip (0: no limit); the norm before,
    a plain tensor (`ParallelMode.clip_gradients`). bucketed clips inside its synchronization
    instead (`Wrapped.synchronize_and_clip`), to the same result."""
    mode = _parallel_mode(config)
    return mode.clip_gradients(model, config.max_grad_norm(), stores_bf16_weights(config.precision))


def micro_batches(
    windows: Windows,
    order: EpochOrder,
    position: int,
    micro_batch: int,
    accumulation: int,
    rank: int,
    world: int,
    device: torch.device,
    boundary: int | None = None,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's micro-batches (`model_inputs` of micro_batch windows each), step after step from
    data position ``position``: of a step's global batch (positions [p, p + G), G = micro_batch x
    accumulation x world) rank r takes the contiguous share [p + r G / world, p + (r + 1) G / world)."""
    share = micro_batch * accumulation
    while True:
        for index in range(accumulation):
            rows = windows[order.ids(position + rank * share + index * micro_batch, micro_batch)]
            yield model_inputs(rows, boundary, device)
        position += share * world


def model_inputs(rows: np.ndarray, boundary: int | None, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Windows (B, context + 1) -> the model's (tokens, targets), (B, context) each, on ``device``;
    with a ``boundary`` id inside a row's tokens also the documents' cumulative lengths
    (`fastlm.data.documents`), so attention stays inside each document (a batch whose rows are
    one document each runs the plain causal path). Copied from pinned memory: asynchronous on a GPU."""
    tensors = [torch.from_numpy(rows)]
    if boundary is not None and (rows[:, 1:-1] == boundary).any():
        tensors.append(torch.from_numpy(cu_seqlens(rows[:, :-1], boundary)))
    if device.type == "cuda":
        tensors = [t.pin_memory() for t in tensors]
    window, *documents = (t.to(device, non_blocking=True) for t in tensors)
    for lengths in documents:
        # each padded count (a power of two) its own graph under torch.compile, a few in a run: a
        # graph over lengths of dynamic size fails to compile with torch 2.11 (docs/attention.md)
        torch._dynamo.mark_static(lengths, 0)
    return window[:, :-1], window[:, 1:], *documents


def evaluation_windows(windows: Windows, config: TrainConfig, world: int) -> int:
    """How many held-out windows an evaluation takes: --eval-sequences, or as many as the split has,
    rounded down to a multiple of --micro-batch x processes (every rank runs the same forwards) and
    at least one such multiple, so the default holds at any number of processes."""
    unit = config.micro_batch * world
    count = min(max(config.eval_sequences, unit), windows.count) // unit * unit
    if count == 0:
        raise UserError(
            f"the held-out split of {config.data} holds {windows.count} window(s) of --context + 1 = "
            f"{config.context + 1} tokens, fewer than --micro-batch x processes = {unit}; use a smaller "
            "--context or --micro-batch, or prepare the data with a larger --held-out"
        )
    return count


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows: Windows,
    count: int,
    config: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    autocast,
    boundary: int | None = None,
) -> float:
    """Mean loss of the first ``count`` held-out windows; each rank takes its contiguous share."""
    share = count // world
    total = torch.zeros((), device=device)
    for first in range(rank * share, (rank + 1) * share, config.micro_batch):
        batch = model_inputs(windows[np.arange(first, first + config.micro_batch)], boundary, device)
        if config.compile == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            total += model(*batch).float() * config.micro_batch
    if world > 1:
        dist.all_reduce(total)
    return total.item() / count


# ---------------------------------------------------------------------------------------------
# Stopping: SIGTERM, non-finite steps
# ---------------------------------------------------------------------------------------------


class StoppedBySignal(Exception):
    """SIGTERM stopped the run after ``step``, whose checkpoint it saved (``saved``; not with
    --checkpoint-every 0)."""

    def __init__(self, step: int, saved: bool) -> None:
        super().__init__(f"stopped by SIGTERM after step {step}")
        self.step, self.saved = step, saved


class _StopSignal:
    """While the run trains (its first evaluation and its steps), SIGTERM only sets ``received``: the
    loop ends after a step, never inside one (a checkpoint needs the whole step). The previous
    handler is back on exit. Python takes handlers only in its main thread: elsewhere SIGTERM keeps
    its own handling."""

    def __init__(self) -> None:
        self.received = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> _StopSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._note)
            self._installed = True
        return self

    def _note(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._installed:  # getsignal's None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)


class _Agreement:
    """Whether any rank raised a flag, the same answer on every rank, so that the ranks stop or skip
    at the same step and none waits in a collective the others never join: a few bytes all-reduced
    between the hosts, in a gloo group (the default one on CPUs, one of its own beside NCCL), so
    agreeing never waits for the device. One process answers its own flags at once."""

    def __init__(self, world: int) -> None:
        self.group = None  # every rank builds it: creating a group is a collective
        if world > 1:
            self.group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._in_flight = None

    def now(self, flags: list[bool]) -> list[bool]:
        """This step's flags of every rank: the host waits for all ranks to reach this point."""
        if self.group is None:
            return flags
        tensor = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(flag) for flag in tensor.tolist()]

    def lagged(self, flags: list[bool]) -> list[bool]:
        """The flags of every rank at the previous call (all False at the first), this call's sent on:
        their all-reduce runs during the next step, which every rank must reach before it ends, so
        no host waits for another. The answer comes a step later than with `now`."""
        if self.group is None:
            return flags
        tensor = torch.tensor(flags, dtype=torch.int32)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        previous, self._in_flight = self._in_flight, (tensor, work)
        if previous is None:
            return [False] * len(flags)
        previous[1].wait()
        return [bool(flag) for flag in previous[0].tolist()]

    def finish(self) -> None:
        """Wait for the all-reduce in flight, when every rank ends the steps together."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None


@contextlib.contextmanager
def _finishing(agreement: _Agreement) -> Iterator[None]:
    """`_Agreement.finish` when the steps end on every rank together: done, or stopped by a decision
    every rank took (not after an error of one rank, whose peers never finish the all-reduce)."""
    try:
        yield
    except (StoppedBySignal, NonFiniteError):
        agreement.finish()
        raise
    agreement.finish()


def _non_finite(step: int, loss: float, norm: float) -> str:
    """The error of a step whose loss (mean over the ranks) or gradient norm is not finite."""
    found = [
        f"the {name} is {value}"
        for name, value in (("loss", loss), ("gradient norm", norm))
        if not math.isfinite(value)
    ]
    return f"step {step}: {' and '.join(found)}, so the run stopped"


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def train(config: TrainConfig) -> dict:
    """Run the training loop (``config`` resolved and checked: `check_config`); returns
    {"step", "losses" (per step of this run, mean over ranks; a mixture of experts' with what its
    routers added), "eval" ([step, loss] pairs),
    "tokens_per_s", "mfu" (medians of the log intervals after the first; None before any),
    "peak_memory_gib"} on every rank. Raises UserError, DataError and CheckpointError with one-sentence messages."""
    rank, world = _rank_and_world(config)
    data = TokenData(config.data)
    train_windows, held_out = data.windows("train", config.context), data.windows("val", config.context)
    if train_windows.count == 0:
        raise UserError(
            f"the training split of {config.data} holds no window of --context + 1 = {config.context + 1} "
            "tokens; use a smaller --context or more text"
        )
    eval_count = evaluation_windows(held_out, config, world)
    record = config.run_record(world, data.sha256, data.tokenizer, data.vocab_size)
    # verified before the process group exists, so a bad checkpoint stops every rank with its message
    resumed = load_for_resume(config, record) if config.resume else None
    if resumed is not None and resumed.step == config.steps:
        if rank == 0:
            print(f"{checkpoint_dir(config)} is at step {resumed.step} of {config.steps}: nothing to train", flush=True)
        return {
            "step": resumed.step,
            "losses": [],
            "eval": [],
            "tokens_per_s": None,
            "mfu": None,
            "peak_memory_gib": None,
        }
    device = _setup(config)
    try:
        check_state_fits_device(config, record, world, device)
        # The loop's model, wrapper and optimizer are freed when it returns, while the process group
        # is still registered. Freed after destroy_process_group, PyTorch DDP's reducer would drop the
        # group's last reference, and the group's destructor joins gloo threads that wait for the GIL
        # the freeing thread holds: a hang at exit.
        pending = [resumed]  # handed over, so the loop can free the loaded tensors once restored
        del resumed
        boundary = data.boundary if config.documents else None
        return _train_loop(
            config, record, pending, rank, world, device, (train_windows, held_out, eval_count, boundary)
        )
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        raise UserError(out_of_memory_message(config, record, world, error)) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_loop(
    config: TrainConfig, record: dict, pending: list, rank: int, world: int, device: torch.device, data
) -> dict:
    """The steps; ``pending`` holds the checkpoint to resume from (or None), taken out here."""
    train_windows, held_out, eval_count, boundary = data
    resumed = pending.pop()
    model_cfg = config.model_config(record["vocab_size"])
    mode = _parallel_mode(config)
    # shapes only, then the weights where the model trains (the host fills about 1 GB of fp32 weights
    # in 20 s per thread: 10b has 51 GB), in the mode's order (fsdp shards first, so no GPU holds the
    # unsharded model); bf16-weights builds its optimizer before wrapping (`ParallelMode.prepare`)
    with torch.device("meta"):
        model = TransformerLM(model_cfg)
    convert_for(model, config.precision)  # fp8: the blocks' linear layers
    wrapped, optimizer = mode.prepare(
        model,
        device,
        _compute_dtype(config),
        materialize=lambda module: _materialize(module, config, device),
        compile=lambda module: _compile(module, config),
        optimizer=lambda module: _optimizer(module, config, device),
        optimizer_first=stores_bf16_weights(config.precision),
    )
    model = wrapped.module
    step, position = 0, 0
    run_id = new_run_id()
    if resumed is not None:
        restore(resumed.state, model, optimizer, config)
        step, position = resumed.step, resumed.state["data"]["position"]
        run_id = resumed.state.get("run_id", run_id)  # absent from the checkpoints of older versions
        resumed = None  # drop the loaded tensors: the model holds them now
    # a mixture of experts' router totals, inside whatever wraps the model
    router_totals = next((m for m in model.modules() if isinstance(m, RouterTotals)), None)
    accumulate = config.accumulation(world)
    tokens_per_step = config.batch_tokens_of(world)
    batches = micro_batches(
        train_windows,
        EpochOrder(train_windows.count, config.seed),
        position,
        config.micro_batch,
        accumulate,
        rank,
        world,
        device,
        boundary,
    )
    autocast = precision_context(config.precision, device)
    if device.type == "cuda":  # the log's peak is training's (materialize drew whole parameters)
        torch.cuda.reset_peak_memory_stats(device)
    meter = Throughput(model_cfg, world, device)
    log = TrainLog(config.out / "log.jsonl", config.steps, step, enabled=rank == 0)
    aside = set_aside(config.out) if rank == 0 and config.overwrite else None
    if rank == 0:
        _write_run_file(config, run_id, record, model_cfg, world, device)  # the end rewrites it with the result
    result = {"losses": [], "eval": []}
    agreement = _Agreement(world)
    with log, _StopSignal() as stop_signal, _finishing(agreement):
        log.note(_describe(config, model_cfg, world, accumulate, tokens_per_step, position, train_windows.count))
        if step > 0:
            log.note(f"resumed from the checkpoint of step {step} in {checkpoint_dir(config)}")
        if config.warmup >= config.steps:
            log.note(f"--warmup {config.warmup} >= --steps {config.steps}: the learning rate never reaches --lr")
        if config.kernels == "fastlm" and device.type == "cpu":
            log.note(CPU_FASTLM_KERNELS)
        if aside is not None:
            until = "saves its first checkpoint" if config.checkpoint_every else "ends"
            log.note(f"--overwrite: the old run is in {aside} until this run {until}")
        if step == 0:
            loss = evaluate(model, held_out, eval_count, config, rank, world, device, autocast, boundary)
            log.write({"step": 0, "eval_loss": loss})
            result["eval"].append([0, loss])
        pending_losses, pending_norms, pending_skipped = [], [], []
        skipped_in_a_row = 0
        batch = next(batches)
        meter.start()
        while step < config.steps:
            lr = warmup_cosine_lr(
                step, lr=config.lr, min_lr=config.lr * config.min_lr_ratio, warmup=config.warmup, steps=config.steps
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = None
            for index in range(accumulate):
                with mode.gradient_sync(model, sync=index == accumulate - 1):
                    if config.compile == "cudagraphs":
                        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
                    with autocast:
                        loss = model(*batch)
                    batch = next(batches)  # its copy overlaps this micro-batch's backward
                    (loss / accumulate).backward()
                # a new tensor, not the graph output that the next replay of a CUDA graph overwrites
                step_loss = loss.detach() / accumulate if step_loss is None else step_loss + loss.detach() / accumulate
            if wrapped.synchronize_and_clip is not None:  # clipped on the gradients' way out of the buckets
                norm = wrapped.synchronize_and_clip(config.max_grad_norm())
            else:
                wrapped.synchronize()  # the wrappers that average after backward do it here
                norm = _clip_gradients(model, config)
            skip = False
            if config.skip_non_finite:  # the host waits for this step's loss (this rank's) and norm
                skip = not torch.stack([step_loss.float(), norm.float()]).isfinite().all()
                stopping, skip = agreement.now([stop_signal.received, bool(skip)])
            if skip:
                skipped_in_a_row += 1
                if skipped_in_a_row > config.skip_non_finite:
                    raise NonFiniteError(
                        f"steps {step + 2 - skipped_in_a_row}-{step + 1}: {skipped_in_a_row} steps in a row had a "
                        f"loss or gradient norm that is not finite, more than --skip-non-finite "
                        f"{config.skip_non_finite} allows, so the run stopped"
                    )
            else:
                skipped_in_a_row = 0
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not config.skip_non_finite:  # under torchrun: a step after the one SIGTERM came in
                (stopping,) = agreement.lagged([stop_signal.received])
            step += 1
            position += tokens_per_step // config.context
            pending_losses.append(step_loss)
            pending_norms.append(norm)
            pending_skipped.append(skip)
            log.advance()
            last = step == config.steps
            stopping = stopping and not last  # the last step ends the run as usual
            evaluating = last or (config.eval_every and step % config.eval_every == 0)
            saving = config.checkpoint_every and (last or stopping or step % config.checkpoint_every == 0)
            if not (evaluating or saving or stopping or step % config.log_every == 0):
                continue
            # one all-reduce: the losses' sum, and the norms (the same on every rank), so that every
            # rank sees a non-finite value wherever one rank has it
            count = len(pending_losses)
            routers = () if router_totals is None else (router_totals.take(),)
            values = torch.cat([torch.stack(pending_losses).float(), torch.stack(pending_norms).float(), *routers])
            if world > 1:
                dist.all_reduce(values)
                values /= world
            values = values.tolist()  # the host waits for the device here, once per log interval
            losses, norms = values[:count], values[count : 2 * count]
            kept = [i for i in range(count) if not pending_skipped[i]]
            for i in kept:  # before anything of this interval is logged or saved
                if not (math.isfinite(losses[i]) and math.isfinite(norms[i])):
                    raise NonFiniteError(_non_finite(step - count + 1 + i, losses[i], norms[i]))
            entry = {"step": step}
            if kept:  # a skipped step's loss is left out (not finite)
                entry["loss"] = sum(losses[i] for i in kept) / len(kept)
            if routers:  # the loss logged is the language model's, without what the routers added
                router_fields = router_totals.fields(values[2 * count :])
                if kept:
                    entry["loss"] -= router_fields["router_loss"]
                entry.update(router_fields)
            entry["lr"] = lr
            if kept:
                entry["grad_norm"] = pending_norms[kept[-1]].item()
            if config.skip_non_finite:
                entry["skipped"] = count - len(kept)
            entry["tokens"] = step * tokens_per_step
            entry.update(meter.interval(count * tokens_per_step))
            result["losses"] += [
                None if skipped else loss for loss, skipped in zip(losses, pending_skipped, strict=True)
            ]
            pending_losses, pending_norms, pending_skipped = [], [], []
            if evaluating:
                entry["eval_loss"] = evaluate(
                    model, held_out, eval_count, config, rank, world, device, autocast, boundary
                )
                result["eval"].append([step, entry["eval_loss"]])
            log.write(entry)
            if saving:
                save_checkpoint(config, step, position, run_id, record, model, optimizer, rank, log)
                if rank == 0 and config.overwrite:
                    discard_set_aside(config.out)
            if stopping:
                raise StoppedBySignal(step, saved=bool(saving))
            meter.start()  # evaluations and checkpoints are not training time
    result = {"step": step, **result, **meter.steady_state()}
    if rank == 0:
        _plot(config, model_cfg, world)
        _write_run_file(config, run_id, record, model_cfg, world, device, result)
        if config.overwrite:  # a run without checkpoints replaces the old one when it ends
            discard_set_aside(config.out)
    if dist.is_initialized():
        # no rank tears down while another still has collectives in flight; on GPUs the barrier is
        # told its device (else PyTorch warns on every run that it guesses it)
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    return result


def _describe(
    config: TrainConfig,
    model_cfg: ModelConfig,
    world: int,
    accumulate: int,
    tokens_per_step: int,
    position: int,
    windows: int,
) -> str:
    parameters = model_cfg.num_parameters()
    return (
        f"training {config.preset} ({parameters / 1e6:.1f}M parameters, {config.kernels} kernels, "
        f"{config.precision}, {config.compile}) on {world} process(es), --parallel {config.parallel}: "
        f"{tokens_per_step:,} tokens per step = {world} x {accumulate} micro-batch(es) of {config.micro_batch} x "
        f"{config.context}; {windows:,} training windows, data position {position:,}"
    )


def _write_run_file(
    config: TrainConfig,
    run_id: str,
    record: dict,
    model_cfg: ModelConfig,
    world: int,
    device: torch.device,
    result: dict | None = None,
) -> None:
    """OUT/run.json: the run's id, its record (`TrainConfig.run_record`), the model's size, the
    bucket size in use and where the run ran; at the end also what `train` returns (the per-step
    losses, the evaluations, steady-state tokens/s and MFU)."""
    config.out.mkdir(parents=True, exist_ok=True)
    run = with_environment(
        {
            "config": record,
            "parameters": model_cfg.num_parameters(),
            "world_size": world,
            # not in the record: a resumed run may change it
            "bucket_mb": config.parallel_spec().bucket_mb,
            "device": str(device),
            "argv": sys.argv,
            "result": result,
        }
    )
    run["run_id"] = run_id  # the training run's, kept across resumes (the environment's is this process's)
    (config.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")


def _plot(config: TrainConfig, model_cfg: ModelConfig, world: int) -> None:
    records = read_log(config.out / "log.jsonl")
    title = (
        f"{config.preset} ({model_cfg.num_parameters() / 1e6:.1f}M) on {config.data.name}, context "
        f"{config.context}, {config.batch_tokens_of(world):,} tokens per step, {world} process(es) · "
        f"{current_device_name()}"
    )
    loss_plot(config.out / "loss.png", {"": records}, title)
    expert_load_plot(config.out / "experts.png", records, title)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def check_config(config: TrainConfig, world: int) -> None:
    """UserError, one sentence, for options that do not fit together and for an OUT that cannot
    take the run: before any work (``config`` resolved)."""
    config.check(world)
    if config.compile == "cudagraphs" and not torch.cuda.is_available():
        raise UserError(CUDAGRAPHS_NEED_A_GPU)
    check_out(config)


def run(config: TrainConfig, prog: str = PROG) -> int:
    """`fastlm train`; 0 when done, 2 after a one-line error for a mistake in the arguments or data
    that does not fit them (options a resumed checkpoint does not take included), 1 for an unusable
    checkpoint (damaged or unreadable) and for a run stopped by a loss, gradient norm or state that
    is not finite (errors print on every rank), 130 after Ctrl-C and 143 after SIGTERM (one line
    from rank 0: what the run left and how to go on)."""
    try:
        config = config.resolved(gpu=torch.cuda.is_available())
        check_config(config, _rank_and_world(config)[1])
        train(config)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print(f"\n{prog}: {after_interrupt(config)}", file=sys.stderr, flush=True)
        return 130
    except StoppedBySignal as stop:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: {after_stop_signal(config, stop.step, stop.saved)}", file=sys.stderr, flush=True)
        return SIGTERM_STATUS
    except NonFiniteError as error:
        report_error(f"{prog}: error: {error}; {after_non_finite(config)}")
        return 1
    except UserError as error:
        report_error(f"{prog}: error: {error}")
        return 2
    except CheckpointError as error:
        report_error(f"{prog}: error: {error}")
        return 1
    return 0


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = Parser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    add_arguments(parser)
    return from_namespace(TrainConfig, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))
