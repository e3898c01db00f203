"""Whether a run's state fits its GPUs, and the one-line messages when it does not.

Outside fsdp every process holds the whole model's weights, gradients and AdamW state.
`check_state_fits` stops a run before anything is built when that state alone exceeds the smallest
GPU of the run; `check_state_fits_host` does the same on a CPU, where the processes share the
host's memory and a run that does not fit swaps or is killed rather than raising. A run that
passes may still run out of memory later on its activations; then `out_of_memory_message` turns
the allocator's error into one sentence that says what each process holds and what would shrink it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fastlm.distributed.wrappers import parallel_mode
from fastlm.settings import STATE_BYTES, default_precision, stores_bf16_weights
from fastlm.train.config import TrainConfig
from fastlm.utils.errors import UserError
from fastlm.utils.host_memory import check_fits_host


def state_bytes(config: TrainConfig, record: dict, world: int) -> tuple[int, int]:
    """(parameters, bytes of weights, gradients and AdamW state each of ``world`` processes holds):
    the precision's `STATE_BYTES` as the --parallel mode divides them (an unresolved --precision is
    either default, fp32 or bf16, which keep the same state)."""
    parameters = config.model_config(record["vocab_size"]).num_parameters()
    per_parameter = STATE_BYTES[config.precision or default_precision(gpu=False)]
    mode = parallel_mode(config.parallel_spec())
    return parameters, int(parameters * mode.state_bytes_per_parameter(per_parameter, world))


def out_of_memory_message(config: TrainConfig, record: dict, world: int, error: BaseException) -> str:
    """One sentence for a run that does not fit: what each process holds, and what would shrink it."""
    first = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
    batch = f"--micro-batch {config.micro_batch} x --context {config.context}"
    if config.parallelism.shards_state:
        return (
            f"out of memory ({first}) with --parallel {config.parallel} at {batch}: use a smaller --micro-batch "
            "or --context"
        )
    parameters, state = state_bytes(config, record, world)
    return (
        f"out of memory ({first}): with --parallel {config.parallel} each process holds {state / 1e9:.1f} GB of "
        f"weights, gradients and AdamW state ({parameters / 1e9:.2f}B parameters) besides the activations of "
        f"{batch}; --parallel fsdp shards all of it across processes (torchrun), or use a smaller --micro-batch, "
        "--context or model"
    )


def smallest_gpu(device: torch.device, world: int) -> int:
    """Bytes of the smallest GPU among the processes (one all-reduce when there are several), so
    that every rank decides `check_state_fits` alike."""
    capacity = torch.cuda.get_device_properties(device).total_memory
    if world == 1:
        return capacity
    smallest = torch.tensor(capacity, dtype=torch.int64, device=device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


def check_state_fits_device(config: TrainConfig, record: dict, world: int, device: torch.device) -> None:
    """`check_state_fits` against the smallest GPU of the run, or `check_state_fits_host` on a CPU."""
    if device.type == "cuda":
        check_state_fits(config, record, world, smallest_gpu(device, world))
    else:
        check_state_fits_host(config, record, world)


def check_state_fits(config: TrainConfig, record: dict, world: int, capacity: int) -> None:
    """Stop at once, before building and compiling, when each process's weights, gradients and
    AdamW state alone exceed its GPU's ``capacity`` bytes (a replicated 10b model: 204 GB); runs
    that fit by this count may still run out of memory on their activations, reported then."""
    if config.parallelism.shards_state:
        return
    parameters, state = state_bytes(config, record, world)
    if state <= capacity:
        return
    shardable = world > 1 and not config.shard_optimizer and not stores_bf16_weights(config.precision)
    shard = " or --shard-optimizer" if shardable else ""
    raise UserError(
        f"with --parallel {config.parallel} each process would hold {state / 1e9:.1f} GB of weights, gradients "
        f"and AdamW state ({parameters / 1e9:.2f}B parameters), more than the GPU's {capacity / 1e9:.1f} GB; "
        f"use --parallel fsdp, which shards all of it across processes (torchrun){shard}, or a smaller model"
    )


def check_state_fits_host(config: TrainConfig, record: dict, world: int) -> None:
    """On a CPU, stop before building when the weights, gradients and AdamW state of this host's
    processes (torchrun's LOCAL_WORLD_SIZE of them; fsdp's each hold 1/world of it) do not fit it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    parameters, state = state_bytes(config, record, world)
    check_fits_host(
        local * state,
        f"the training state of {local} process(es) (weights, gradients and AdamW moments of "
        f"{parameters / 1e9:.2f}B parameters)",
        "use a smaller model (--preset, --d-model, --layers) or fewer processes",
    )
