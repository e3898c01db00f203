"""The data-parallel wrappers by name: how each parallel mode wraps a model and averages gradients.

    none        the model itself, no averaging (one process; or the compute-only step of a benchmark)
    naive       `allreduce_gradients` after backward, one all-reduce per parameter
    flat        the same, all gradients flattened into one buffer and one all-reduce
    ddp         fastlm `DDP`: an async all-reduce per parameter, started from its gradient hook
    bucketed    fastlm `BucketedDDP`, buckets of `bucket_mb` MB (required)
    torch-ddp   PyTorch `DistributedDataParallel`, buckets of `bucket_mb` MB (PyTorch's 25 without)
    fsdp        PyTorch FSDP2 `fully_shard` on groups of consecutive `model.blocks` of at least
                `bucket_mb` MB of gathered weights (default: each block alone) and on the root:
                parameters, gradients and optimizer state sharded (a `TransformerLM`; `_fsdp` says how)

A mode is given as a `ParallelSpec`; `wrap(model, spec, device, compute_dtype)` returns the module
to call and the synchronization to run after backward (nothing for the wrappers that synchronize
inside backward), for bucketed also one that clips the gradients while it hands them out.
``compute_dtype`` is the autocast dtype the forward runs under (None: no autocast); only fsdp uses
it, to all-gather the blocks' weights in that dtype. Importing this module needs no torch, so the
command line parses a spec without it; `wrap` imports the wrappers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODES = ("none", "naive", "flat", "ddp", "bucketed", "torch-ddp", "fsdp")
BUCKETED_MODES = ("bucketed", "torch-ddp", "fsdp")  # the modes that take a bucket (fsdp: unit) size
# `fastlm train`'s sizes (MB of 1e6 bytes) where --bucket-mb is not given. fsdp: small blocks are
# bound by the host's per-unit work (hooks, collectives' launches), so units gather blocks up to
# 120 MB (the small preset: one unit of all 12 blocks, the fastest measured, docs/notes/distributed.md);
# blocks of 120 MB and more stay alone.
DEFAULT_BUCKET_MB = {"bucketed": 25.0, "torch-ddp": 25.0, "fsdp": 120.0}
# bucketed's size where the model is compiled as one graph: every gradient arrives at the end of its
# backward, so small buckets overlap nothing and only add all-reduce calls and their fixed costs.
# 500 MB holds the small preset's 455 MB of fp32 gradients in one bucket; larger models get a few.
COMPILED_BUCKETED_MB = 500.0
# fsdp keeps every block's gathered weights from its forward to its backward (one all-gather per
# block and step instead of two) while all of them together take at most this many bytes: 2B
# parameters in bf16, 5% of an 80 GB GPU. A fixed size, not a share of the device's memory, so that
# every rank decides the same (a rank that gathers in backward alone would wait for the others)
GATHERED_BYTES_LIMIT = 4 * 2**30


def bucket_mb_in_use(mode: str, bucket_mb: float | None, compiled: bool = False) -> float | None:
    """The bucket (fsdp: unit) size a mode runs with: ``bucket_mb`` or the mode's default (bucketed's
    under torch.compile of the whole model where ``compiled``); None for the modes without buckets."""
    if mode not in BUCKETED_MODES:
        return None
    if bucket_mb:
        return bucket_mb
    return COMPILED_BUCKETED_MB if compiled and mode == "bucketed" else DEFAULT_BUCKET_MB[mode]


REDUCE_DTYPES = ("fp32", "bf16")  # what gradients are averaged in across ranks


@dataclass(frozen=True)
class ParallelSpec:
    """A parallel mode (one of MODES), for the bucketed ones the bucket size in MB, and the dtype
    the gradients are averaged in (one of REDUCE_DTYPES: fp32, or bf16 to halve the bytes)."""

    mode: str
    bucket_mb: float | None = None
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown parallel mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.mode == "bucketed" and self.bucket_mb is None:
            raise ValueError("parallel mode bucketed needs bucket_mb, the bucket size in MB")
        if self.bucket_mb is not None and self.mode not in BUCKETED_MODES:
            raise ValueError(f"parallel mode {self.mode} takes no bucket_mb; only {', '.join(BUCKETED_MODES)} do")
        if self.bucket_mb is not None and not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"bucket_mb must be a positive finite number of MB, got {self.bucket_mb}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.reduce_dtype != "fp32" and self.mode == "none":
            raise ValueError("parallel mode none averages no gradients: reduce_dtype must stay fp32")

    def torch_reduce_dtype(self):
        """The reduce dtype as a torch dtype for the wrappers: None for fp32 (the gradients' own)."""
        import torch

        return torch.bfloat16 if self.reduce_dtype == "bf16" else None


@dataclass(frozen=True)
class Wrapped:
    module: Any  # torch.nn.Module: what the training step calls
    synchronize: Callable[[], None]  # after backward: finishes averaging the gradients over the ranks
    # bucketed: the same synchronization clipping the gradients to a global norm (inf: none) on their
    # way out of the buckets, returning the norm before (a tensor); None: clip after `synchronize`
    synchronize_and_clip: Callable[[float], torch.Tensor] | None = None


def _none(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    return Wrapped(model, lambda: None)


def _after_backward(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    from fastlm.distributed.ddp import allreduce_gradients

    reduce_dtype = spec.torch_reduce_dtype()
    return Wrapped(model, lambda: allreduce_gradients(model, spec.mode == "flat", reduce_dtype))


def _ddp(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    from fastlm.distributed.ddp import DDP

    wrapped = DDP(model, spec.torch_reduce_dtype())
    return Wrapped(wrapped, wrapped.finish_gradient_synchronization)


def _bucketed(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    from fastlm.distributed.ddp import BucketedDDP

    wrapped = BucketedDDP(model, spec.bucket_mb, spec.torch_reduce_dtype())
    return Wrapped(wrapped, wrapped.finish_gradient_synchronization, wrapped.finish_gradient_synchronization)


def _torch_ddp(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    buckets = {} if spec.bucket_mb is None else {"bucket_cap_mb": spec.bucket_mb}
    wrapped = DistributedDataParallel(model, device_ids=device_ids, **buckets)
    if spec.reduce_dtype == "bf16":
        from fastlm.distributed.ddp import bf16_reduce_hook

        wrapped.register_comm_hook(None, bf16_reduce_hook)
    return Wrapped(wrapped, lambda: None)


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


def _fsdp(model, spec: ParallelSpec, device, compute_dtype) -> Wrapped:
    """One FSDP unit per group of blocks (`sharding_units`; when one group holds all of them, the
    `BlockStack` itself, so that it compiles as one graph), then the root (embedding, final norm,
    LM head).

    - Blocks all-gather their weights in ``compute_dtype``: under autocast every matmul would cast
      an fp32 weight to it anyway, so gathering fp32 moves twice the bytes for the same values.
      Gradients are reduce-scattered in the spec's reduce dtype (fp32 unless bf16 is asked for). The blocks' inputs
      are not cast (the residual stream stays fp32, as autocast leaves it); the norm weights, the
      one thing autocast would have multiplied in fp32, are used rounded to ``compute_dtype``.
    - The root stays fp32: the embedding's backward accumulates its gradient in the weight's
      dtype, and fastlm's fused loss accumulates the LM head's in fp32 from an fp32 weight. FSDP
      keeps the root gathered from forward to backward by itself.
    - The last block always keeps its weights gathered after forward (backward starts with it);
      the others too while the model is small enough (`keeps_gathered`), so backward all-gathers
      nothing. Backward drops the gathered weights; a forward without backward (an evaluation)
      leaves them for the next forward, which reuses them: evaluate after the optimizer step, not
      between backward and step (as the root, which FSDP never reshards after forward, needed already).
    - Each unit starts the next one's all-gather as soon as its own has arrived (explicit forward
      prefetch) rather than when the host reaches the next forward: when the host is the
      bottleneck, a gather issued only then leaves the GPU waiting for it.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = sharding_units(list(model.blocks), spec.bucket_mb, compute_dtype)
    if len(units) == 1:  # `stack_is_one_unit`: the stack itself, which the loop compiles as one graph
        units = [model.blocks]
    gathered = keeps_gathered(model, compute_dtype)
    reduce_dtype = spec.torch_reduce_dtype() or torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for index, unit in enumerate(units):
        fully_shard(unit, mp_policy=policy, reshard_after_forward=not gathered and index < len(units) - 1)
    root = fully_shard(model, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))  # fp32 weights
    # a unit of several modules shares one FSDP state: its first module stands for it
    firsts = [unit if isinstance(unit, torch.nn.Module) else unit[0] for unit in units]
    for unit, following in itertools.pairwise([root, *firsts]):  # the forward order
        unit.set_modules_to_forward_prefetch([following])
    return Wrapped(root, lambda: None)


CONSTRUCTORS: dict[str, Callable[[Any, ParallelSpec, Any, Any], Wrapped]] = {
    "none": _none,
    "naive": _after_backward,
    "flat": _after_backward,
    "ddp": _ddp,
    "bucketed": _bucketed,
    "torch-ddp": _torch_ddp,
    "fsdp": _fsdp,
}


def wrap(
    model: torch.nn.Module, spec: ParallelSpec, device: torch.device, compute_dtype: torch.dtype | None = None
) -> Wrapped:
    """``model`` (on ``device``, inside an initialized process group unless mode none) wrapped for
    ``spec``'s mode; ``compute_dtype``: the autocast dtype of its forward (None: no autocast)."""
    return CONSTRUCTORS[spec.mode](model, spec, device, compute_dtype)
