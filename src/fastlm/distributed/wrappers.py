"""The parallel modes as objects: one class per mode of `fastlm.settings.PARALLEL` (whose docstring
says what each does) holds everything of a training run that depends on it, so the training loop,
its checkpoints and the memory estimates ask the mode and never test its name:

    prepare                 the meta-device model materialized, wrapped and compiled, and its
                            optimizer built, in the mode's order
    wrap                    the module to call and the synchronization to run after backward
    compile                 what torch.compile compiles (the whole model, or fsdp's blocks)
    optimizer               AdamW: PyTorch's, in `ShardedOptimizer` (shard_optimizer), or fsdp's
                            on the local shards
    gradient_sync           the context of a micro-batch's backward: no-sync while accumulating
    clip_gradients          the global gradient norm, and the gradients scaled to a limit
    training_state, restore the state in the layout of an unsharded single-process run, and back
    state_bytes_per_parameter   what each process holds of a precision's `STATE_BYTES`

`parallel_mode(spec)` is the mode of a `ParallelSpec`; `wrap(model, spec, device, compute_dtype)` its
wrapped module. ``compute_dtype`` is the autocast dtype the forward runs under (None: no autocast);
only fsdp uses it, to all-gather the blocks' weights in that dtype. Importing this module needs no
torch (the modes import it on first use), so the command line and `fastlm analyze` use it without.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastlm.settings import (
    COMPILED_BUCKETED_MB,
    DEFAULT_BUCKET_MB,
    REDUCE_DTYPES,
    ParallelSpec,
    StateBytes,
    bucket_mb_in_use,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "COMPILED_BUCKETED_MB",
    "DEFAULT_BUCKET_MB",
    "GATHERED_BYTES_LIMIT",
    "MODES",
    "REDUCE_DTYPES",
    "ParallelMode",
    "ParallelSpec",
    "Wrapped",
    "bucket_mb_in_use",
    "keeps_gathered",
    "parallel_mode",
    "sharding_units",
    "stack_is_one_unit",
    "wrap",
]

# fsdp keeps every block's gathered weights from its forward to its backward (one all-gather per
# block and step instead of two) while all of them together take at most this many bytes: 2B
# parameters in bf16, 5% of an 80 GB GPU. A fixed size, not a share of the device's memory, so that
# every rank decides the same (a rank that gathers in backward alone would wait for the others)
GATHERED_BYTES_LIMIT = 4 * 2**30


@dataclass(frozen=True)
class Wrapped:
    module: Any  # torch.nn.Module: what the training step calls
    synchronize: Callable[[], None]  # after backward: finishes averaging the gradients over the ranks
    # bucketed: the same synchronization clipping the gradients to a global norm (inf: none) on their
    # way out of the buckets, returning the norm before (a tensor); None: clip after `synchronize`
    synchronize_and_clip: Callable[[float], torch.Tensor] | None = None


def keeps_gathered(model, compute_dtype) -> bool:
    """Whether fsdp keeps the blocks' gathered weights from forward to backward: when all of them
    in ``compute_dtype`` (None: their own) take at most GATHERED_BYTES_LIMIT."""
    return _gathered_bytes(model.blocks, compute_dtype) <= GATHERED_BYTES_LIMIT


def _gathered_bytes(module, compute_dtype) -> int:
    """Bytes of ``module``'s weights all-gathered in ``compute_dtype`` (None: their own dtypes)."""
    return sum(p.numel() * (compute_dtype or p.dtype).itemsize for p in module.parameters())


def stack_is_one_unit(model, spec: ParallelSpec, compute_dtype) -> bool:
    """Whether fsdp shards ``model.blocks`` as one unit (`sharding_units` groups all blocks)."""
    return len(sharding_units(list(model.blocks), spec.bucket_mb, compute_dtype)) == 1


def sharding_units(blocks: list, unit_mb: float | None, compute_dtype) -> list[list]:
    """Consecutive blocks grouped into units of at least ``unit_mb`` MB of weights in
    ``compute_dtype`` (None: their own), the last unit taking what is left; None: one block each.
    Each unit costs the host FSDP's hooks and a collective each way per step, so small blocks go
    together; big ones stay alone, which keeps the gathered weights at one block's."""
    if unit_mb is None:
        return [[block] for block in blocks]
    units, current, size = [], [], 0
    for block in blocks:
        current.append(block)
        size += _gathered_bytes(block, compute_dtype)
        if size >= unit_mb * 1e6:
            units.append(current)
            current, size = [], 0
    if current:
        if units and size < unit_mb * 1e6:
            units[-1].extend(current)
        else:
            units.append(current)
    return units


class ParallelMode:
    """A parallel mode at run time, for ``spec``. This class is mode none: one process trains the
    model itself and averages nothing; the other modes change what differs from it."""

    compiles_whole_model = True  # what `compile` compiles; False: the blocks only, the root runs eager

    def __init__(self, spec: ParallelSpec) -> None:
        self.spec = spec

    def prepare(
        self,
        model: torch.nn.Module,
        device: torch.device,
        compute_dtype: torch.dtype | None,
        materialize: Callable[[torch.nn.Module], None],
        compile: Callable[[torch.nn.Module], None],
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        optimizer_first: bool = False,
    ) -> tuple[Wrapped, torch.optim.Optimizer]:
        """``model``, built on the meta device, ready to train: its weights materialized, wrapped,
        compiled and its optimizer built, each by the function given, in this mode's order. Here
        every rank materializes the whole model, then wraps it, then compiles the wrapped module.
        ``optimizer_first`` builds the optimizer before wrapping (bf16-weights: its optimizer stores
        the matmul weights in bf16, before a wrapper sizes its gradient buckets by their dtypes);
        otherwise it is built last, over the wrapped module's parameters."""
        materialize(model)
        built = optimizer(model) if optimizer_first else None
        wrapped = self.wrap(model, device, compute_dtype)
        compile(wrapped.module)
        return wrapped, built if built is not None else optimizer(wrapped.module)

    def wrap(self, model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype | None) -> Wrapped:
        """``model`` (on ``device``, inside an initialized process group unless mode none) wrapped."""
        return Wrapped(model, lambda: None)

    def compile(self, model: torch.nn.Module, mode: str, compute_dtype: torch.dtype | None) -> None:
        """Compile ``model`` in place with torch.compile(mode=``mode``), so its state-dict keys stay
        those of the eager model. Here the whole model: one graph hands every gradient to ddp's and
        bucketed's hooks at the end of backward, so their all-reduces do not overlap it; compiling
        block by block would let them, but measured slower for ddp (the host, with a compiled call
        per block and a hook per gradient, falls behind the GPUs). torch-ddp splits its graph at its
        buckets by itself."""
        model.compile(mode=mode)

    def optimizer(self, groups: list[dict], **options: Any) -> torch.optim.Optimizer:
        """PyTorch's AdamW over the parameter ``groups`` with ``options`` (lr, betas, fused), inside a
        `ShardedOptimizer` where the spec shards the optimizer state."""
        import torch

        if self.spec.shard_optimizer:
            from fastlm.distributed.sharded_optimizer import ShardedOptimizer

            return ShardedOptimizer(groups, torch.optim.AdamW, **options)
        return torch.optim.AdamW(groups, **options)

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-batch's backward through ``module`` (the wrapped one): without
        ``sync`` (micro-batches before a step's last) the gradients accumulate locally. Here nothing
        synchronizes during backward."""
        return contextlib.nullcontext()

    def clip_gradients(self, module: torch.nn.Module, max_norm: float, bf16_weights: bool) -> torch.Tensor:
        """Scale the gradients of ``module`` to a global norm of at most ``max_norm`` (inf: no limit);
        the norm before, a plain tensor. ``bf16_weights``: every gradient's norm summed in fp32
        (`fastlm.optim.clip.grad_norm`), not in the gradients' bf16."""
        import torch

        if not bf16_weights:
            return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        from fastlm.optim.clip import grad_norm

        params = [p for p in module.parameters() if p.grad is not None]
        norm = grad_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def training_state(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The (model, optimizer) state dicts in the layout of an unsharded single-process run; every
        rank takes part. Here the replica's own (a `ShardedOptimizer` gathers its state itself)."""
        return getattr(module, "module", module).state_dict(), optimizer.state_dict()

    def restore(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
    ) -> None:
        """Load the state dicts of `training_state` into ``module`` and ``optimizer``."""
        getattr(module, "module", module).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def state_bytes_per_parameter(self, state: StateBytes, world: int) -> float:
        """Bytes per parameter each of ``world`` processes holds of ``state`` (a precision's
        `STATE_BYTES`): all of it, AdamW's state divided over the processes where it is sharded."""
        return state.weights + state.gradients + state.optimizer / (world if self.spec.shard_optimizer else 1)

    def torch_reduce_dtype(self) -> torch.dtype | None:
        """The spec's reduce dtype as the wrappers take it: None for fp32 (the gradients' own)."""
        import torch

        return torch.bfloat16 if self.spec.reduce_dtype == "bf16" else None


class AfterBackward(ParallelMode):
    """naive: `allreduce_gradients` after the last micro-batch's backward, one all-reduce per
    parameter; nothing runs during backward, so accumulating needs no no-sync."""

    flatten = False  # flat: all gradients flattened into one buffer and one all-reduce

    def wrap(self, model, device, compute_dtype) -> Wrapped:
        from fastlm.distributed.ddp import allreduce_gradients

        reduce_dtype = self.torch_reduce_dtype()
        return Wrapped(model, lambda: allreduce_gradients(model, self.flatten, reduce_dtype))


class Flat(AfterBackward):
    """flat: as naive, with one all-reduce of all gradients flattened together."""

    flatten = True


class Overlapping(ParallelMode):
    """The wrappers whose gradient hooks start all-reduces during backward; their ``no_sync()``
    skips them while micro-batches accumulate."""

    def gradient_sync(self, module, sync: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if sync else module.no_sync()


class FastlmDDP(Overlapping):
    """ddp: fastlm's `DDP`, an async all-reduce per parameter started from its gradient hook."""

    def wrap(self, model, device, compute_dtype) -> Wrapped:
        from fastlm.distributed.ddp import DDP

        wrapped = DDP(model, self.torch_reduce_dtype())
        return Wrapped(wrapped, wrapped.finish_gradient_synchronization)


class Bucketed(Overlapping):
    """bucketed: fastlm's `BucketedDDP`, which also clips the gradients on their way out of the
    buckets (`Wrapped.synchronize_and_clip`), to the same result as clipping after."""

    def wrap(self, model, device, compute_dtype) -> Wrapped:
        from fastlm.distributed.ddp import BucketedDDP

        wrapped = BucketedDDP(model, self.spec.bucket_mb, self.torch_reduce_dtype())
        return Wrapped(wrapped, wrapped.finish_gradient_synchronization, wrapped.finish_gradient_synchronization)


class TorchDDP(Overlapping):
    """torch-ddp: PyTorch's `DistributedDataParallel`, buckets of the spec's MB (PyTorch's without)."""

    def wrap(self, model, device, compute_dtype) -> Wrapped:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        buckets = {} if self.spec.bucket_mb is None else {"bucket_cap_mb": self.spec.bucket_mb}
        # broadcast_buffers=False: the model's buffers are RoPE's tables, the same on every rank,
        # and a mixture of experts' router totals, each rank's own until the log step sums them
        wrapped = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False, **buckets)
        if self.spec.reduce_dtype == "bf16":
            from fastlm.distributed.ddp import bf16_reduce_hook

            wrapped.register_comm_hook(None, bf16_reduce_hook)
        return Wrapped(wrapped, lambda: None)


class FSDP(ParallelMode):
    """fsdp: PyTorch's FSDP2 on units of blocks and the root (`wrap`); parameters, gradients and
    AdamW state sharded, clipped and stepped on the local shards (`fastlm.distributed.local_shards`)."""

    compiles_whole_model = False

    def prepare(self, model, device, compute_dtype, materialize, compile, optimizer, optimizer_first=False):
        """Compile the blocks first (FSDP's hooks then run around their graphs), shard, then
        materialize the shards (`fastlm.model.materialize` initializes each parameter whole, one at a
        time, so no GPU holds the unsharded model) and build the optimizer over them. FSDP replaces
        the parameters: no optimizer can be built before (``optimizer_first``)."""
        if optimizer_first:
            raise ValueError("fsdp replaces the parameters as it shards them: build the optimizer after wrapping")
        compile(model)
        wrapped = self.wrap(model, device, compute_dtype)
        materialize(wrapped.module)
        return wrapped, optimizer(wrapped.module)

    def wrap(self, model, device, compute_dtype) -> Wrapped:
        """One FSDP unit per group of blocks (`sharding_units`; when one group holds all of them, the
        `BlockStack` itself, so that it compiles as one graph), then the root (embedding, final norm,
        LM head).

        - Blocks all-gather their weights in ``compute_dtype``: under autocast every matmul would
          cast an fp32 weight to it anyway, so gathering fp32 moves twice the bytes for the same
          values. Gradients are reduce-scattered in the spec's reduce dtype (fp32 unless bf16 is
          asked for). The blocks' inputs are not cast (the residual stream stays fp32, as autocast
          leaves it); the norm weights, the one thing autocast would have multiplied in fp32, are
          used rounded to ``compute_dtype``.
        - The root stays fp32: the embedding's backward accumulates its gradient in the weight's
          dtype, and fastlm's fused loss accumulates the LM head's in fp32 from an fp32 weight. FSDP
          keeps the root gathered from forward to backward by itself.
        - The last block always keeps its weights gathered after forward (backward starts with it);
          the others too while the model is small enough (`keeps_gathered`), so backward all-gathers
          nothing. Backward drops the gathered weights; a forward without backward (an evaluation)
          leaves them for the next forward, which reuses them: evaluate after the optimizer step,
          not between backward and step (as the root, which FSDP never reshards after forward,
          needed already).
        - Each unit starts the next one's all-gather as soon as its own has arrived (explicit
          forward prefetch) rather than when the host reaches the next forward: when the host is the
          bottleneck, a gather issued only then leaves the GPU waiting for it.
        """
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        units = sharding_units(list(model.blocks), self.spec.bucket_mb, compute_dtype)
        if len(units) == 1:  # `stack_is_one_unit`: the stack itself, which `compile` compiles as one graph
            units = [model.blocks]
        gathered = keeps_gathered(model, compute_dtype)
        reduce_dtype = self.torch_reduce_dtype() or torch.float32
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        for index, unit in enumerate(units):
            fully_shard(unit, mp_policy=policy, reshard_after_forward=not gathered and index < len(units) - 1)
        root = fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))  # fp32 weights
        # a unit of several modules shares one FSDP state: its first module stands for it
        firsts = [unit if isinstance(unit, torch.nn.Module) else unit[0] for unit in units]
        for unit, following in itertools.pairwise([root, *firsts]):  # the forward order
            unit.set_modules_to_forward_prefetch([following])
        return Wrapped(root, lambda: None)

    def compile(self, model, mode: str, compute_dtype) -> None:
        """Before sharding: the blocks' stack as one graph where it is one unit (its forward: FSDP's
        hooks run around the graph; small models, whose step is bound by the host's per-graph and
        per-hook work: docs/notes/distributed.md), else each block (the graphs stop at FSDP's hooks
        between units). The root (embedding, final norm, loss) runs eager."""
        import torch

        if stack_is_one_unit(model, self.spec, compute_dtype):
            model.blocks.forward = torch.compile(model.blocks.forward, mode=mode)
        else:
            for block in model.blocks:
                block.compile(mode=mode)

    def optimizer(self, groups: list[dict], **options: Any) -> torch.optim.Optimizer:
        """`local_shards.AdamW`: PyTorch's, stepping the local shards of the DTensor parameters."""
        from fastlm.distributed import local_shards  # imports DTensor's half second of modules on first use

        return local_shards.AdamW(groups, **options)

    def gradient_sync(self, module, sync: bool) -> contextlib.AbstractContextManager:
        module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_gradients(self, module, max_norm: float, bf16_weights: bool) -> torch.Tensor:
        """On the local shards (`local_shards.clip_grad_norm_`); fsdp keeps fp32 weights."""
        from fastlm.distributed import local_shards

        return local_shards.clip_grad_norm_(module.parameters(), max_norm)

    def training_state(self, module, optimizer) -> tuple[dict, dict]:
        """Gathered whole (full state dicts) onto the CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def restore(self, module, optimizer, model_state: dict, optimizer_state: dict) -> None:
        """Each rank keeps its shards of the full state dicts."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_state_dict(
            module, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )

    def state_bytes_per_parameter(self, state: StateBytes, world: int) -> float:
        return state.total / world  # all of it sharded


# The mode of each name of `fastlm.settings.PARALLEL`
MODES: dict[str, type[ParallelMode]] = {
    "none": ParallelMode,
    "naive": AfterBackward,
    "flat": Flat,
    "ddp": FastlmDDP,
    "bucketed": Bucketed,
    "torch-ddp": TorchDDP,
    "fsdp": FSDP,
}


def parallel_mode(spec: ParallelSpec) -> ParallelMode:
    """The mode object of ``spec``."""
    return MODES[spec.mode](spec)


def wrap(
    model: torch.nn.Module, spec: ParallelSpec, device: torch.device, compute_dtype: torch.dtype | None = None
) -> Wrapped:
    """``model`` (on ``device``, inside an initialized process group unless mode none) wrapped for
    ``spec``'s mode; ``compute_dtype``: the autocast dtype of its forward (None: no autocast)."""
    return parallel_mode(spec).wrap(model, device, compute_dtype)
