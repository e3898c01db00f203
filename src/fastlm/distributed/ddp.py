"""Gradient averaging for data parallelism: after-backward all-reduce, and two overlapping wrappers.

Every rank holds a full replica and sees a different shard of the batch; after backward each
gradient is averaged over the ranks, so the replicas take identical optimizer steps.

- `allreduce_gradients(model, flat)`: after backward, one all-reduce per parameter (n calls, each
  paying the per-call latency o) or one of all gradients flattened together (1 call, plus a copy in
  and out of the flat buffer). No overlap with the backward.
- `DDP(module)`: an async all-reduce starts for each parameter as soon as its gradient is
  accumulated (a post-accumulate-grad hook), so communication overlaps the rest of the backward.
- `BucketedDDP(module, bucket_size_mb)`: the same with gradients grouped into buckets of at most
  `bucket_size_mb` (filled in reverse parameter order, the order backward produces them), one async
  all-reduce per bucket once every gradient in it is ready: fewer calls than DDP, still overlapped.

Each takes ``reduce_dtype``: None (the default) reduces the gradients in their own dtype (fp32 for
fp32 weights); torch.bfloat16 casts them to bf16 for the all-reduce and back after it, halving the
bytes on the wire at bf16's precision (8 bits of mantissa: a sum over R ranks is off by up to about
R x 2^-9 of its terms' size).

Both wrappers broadcast parameters and buffers from rank 0 at construction, after checking that
every rank built the same model (a mismatch would otherwise hang in a collective); handle frozen
and tied parameters (`parameters()` lists a shared tensor once, and its hook fires once per backward
after all its uses have accumulated); offer `no_sync()` for gradient accumulation; and need
`finish_gradient_synchronization()` after backward, which waits for the all-reduces and averages.

Averaging: NCCL's all-reduce averages in the reduction itself (``ReduceOp.AVG``), so no pass over
the gradients divides them afterwards; gloo has no AVG, so it sums and the gradients are divided.
`BucketedDDP` hands each parameter a view of its bucket's reduced buffer as its gradient when the
buffer is in the gradient's dtype, rather than copying the buffer back: one pass over the
gradients' memory per step (the copy into the bucket), not three (with a division and a copy back).
With a bf16 wire and fp32 weights, the gradients are views of one fp32 buffer cast from the bf16
one in a single pass (`fastlm.ops.scaled_cast`); the old gradients are freed when their bucket
launches, so between a bucket's launch and `finish_gradient_synchronization` its parameters'
``grad`` is None. `finish_gradient_synchronization(max_norm)` also clips the gradients, as clipping
after it would; in that case by the bf16 buffers' norm and in the cast, where clipping after the
cast reads the fp32 gradients twice (norm, scale) and writes them once more.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fastlm.ops.common import DTYPES
from fastlm.ops.scaled_cast import scaled_cast
from fastlm.optim.clip import grad_norm


def _world() -> int:
    return dist.get_world_size()


def _averaging() -> tuple[dist.ReduceOp, bool]:
    """(the all-reduce op that averages, whether the result must still be divided by the world
    size): NCCL's AVG, else (gloo) a sum."""
    if dist.get_backend() == "nccl":
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


def _wire(tensor: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """What goes into the all-reduce: ``tensor`` itself, or a copy in ``reduce_dtype``."""
    return tensor if reduce_dtype is None or tensor.dtype == reduce_dtype else tensor.to(reduce_dtype)


def allreduce_gradients(model: nn.Module, flat: bool = False, reduce_dtype: torch.dtype | None = None) -> None:
    """Average every existing gradient of ``model`` over all ranks, in place, after backward: a sum
    and a division on every backend, the plain baseline the overlapping wrappers are measured against."""
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if not grads:
        return
    if flat:
        buffer = _wire(_flatten_dense_tensors(grads), reduce_dtype)
        dist.all_reduce(buffer)
        buffer /= _world()
        for grad, averaged in zip(grads, _unflatten_dense_tensors(buffer, grads), strict=True):
            grad.copy_(averaged)
        return
    for grad in grads:
        sent = _wire(grad, reduce_dtype)
        dist.all_reduce(sent)
        if sent is grad:
            grad /= _world()
        else:
            grad.copy_(sent / _world())


def _check_same_model(module: nn.Module) -> None:
    """Raise ValueError on every rank if the ranks' models differ in parameter names, shapes or dtypes."""
    signature = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    signature += [(name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()]
    gathered: list = [None] * _world()
    dist.all_gather_object(gathered, signature)
    for rank, other in enumerate(gathered):
        if other != gathered[0]:
            first = next((a, b) for a, b in zip(gathered[0] + [None], other + [None], strict=False) if a != b)
            raise ValueError(
                f"rank {rank}'s model differs from rank 0's ({len(other)} vs {len(gathered[0])} parameters and "
                f"buffers; first difference: rank 0 has {first[0]}, rank {rank} has {first[1]})"
            )


def _broadcast_state(module: nn.Module) -> None:
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


class _DataParallel(nn.Module):
    """What both wrappers share: construction checks, broadcast, forward, no_sync."""

    def __init__(self, module: nn.Module, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
        self.module, self.reduce_dtype = module, reduce_dtype
        self._op, self._divide = _averaging()
        _check_same_model(module)
        _broadcast_state(module)
        self._sync = True
        # The hooks reach the wrapper through a weak reference: a strong one would make a cycle
        # through the parameters that the garbage collector cannot see, so a dropped wrapper would
        # keep its model's memory alive.
        wrapper = weakref.ref(self)

        def on_gradient(param: torch.Tensor) -> None:
            alive = wrapper()
            if alive is not None:
                alive._on_gradient(param)

        self._hooks = [
            p.register_post_accumulate_grad_hook(on_gradient) for p in module.parameters() if p.requires_grad
        ]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after syncs the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_gradient(self, param: torch.Tensor) -> None:
        raise NotImplementedError


class DDP(_DataParallel):
    """One async all-reduce per parameter, started when its gradient is ready."""

    def __init__(self, module: nn.Module, reduce_dtype: torch.dtype | None = None) -> None:
        self._pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []  # (work, sent, gradient)
        super().__init__(module, reduce_dtype)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._sync:
            sent = _wire(param.grad, self.reduce_dtype)
            self._pending.append((dist.all_reduce(sent, op=self._op, async_op=True), sent, param.grad))

    def finish_gradient_synchronization(self) -> None:
        """Wait for the all-reduces started during backward; average where they summed."""
        for work, _, _ in self._pending:
            work.wait()
        if self._pending:
            if self._divide:
                torch._foreach_div_([s for _, s, _ in self._pending], _world())  # one launch, not one per gradient
            copied = [(g, s) for _, s, g in self._pending if s is not g]
            if copied:
                torch._foreach_copy_([g for g, _ in copied], [s for _, s in copied])
        self._pending.clear()


def _widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether every ``narrow`` value is exactly a ``wide`` one (bf16 in fp32), they differ, and
    `scaled_cast` takes ``wide``."""
    return narrow != wide and torch.promote_types(narrow, wide) == wide and wide in DTYPES


GRADIENT_ALIGN_BYTES = 128  # each gradient's slice of a bucket starts at a multiple: vectorized loads, fused optimizers


class _Bucket:
    """Parameters whose gradients are reduced together, flat in one buffer of the wire dtype:
    ``reduce_dtype``, else the parameters' promoted dtype (bf16 matmul weights next to fp32 norms
    are reduced in fp32). Each gradient's slice starts 128-byte aligned, as a gradient of its own
    would; the gaps between slices go through the all-reduce unread."""

    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype | None) -> None:
        self.params = params
        self.dtype = reduce_dtype or functools.reduce(torch.promote_types, (p.dtype for p in params))
        align = max(1, GRADIENT_ALIGN_BYTES // self.dtype.itemsize)
        self.offsets, end = [], 0
        for param in params:
            self.offsets.append(end)
            end += -(-param.numel() // align) * align
        self.numel = end
        self.ready = 0
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # each parameter's slice of the buffer, in its shape
        # the parameters' one dtype where it is wider than the wire's (fp32 weights, bf16 wire): the
        # bucket casts its buffer back into one new buffer of it, exactly, scaled on the way if asked
        dtypes = {param.dtype for param in params}
        self.wider = next(iter(dtypes)) if len(dtypes) == 1 and _widens(self.dtype, *dtypes) else None
        self.work: dist.Work | None = None

    def launch(self, op: dist.ReduceOp) -> None:
        """Copy the bucket's gradients into a new flat buffer (one launch, cast to the wire dtype on
        the way; zeros for any that backward did not produce) and start their all-reduce. A bucket
        that casts back into new gradients (`wider`) frees the old ones here, so that they do not
        stay allocated beside the buffer: its parameters' ``grad`` is None until `cast_out`."""
        self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.params[0].device)
        self.views = [
            self.buffer[offset : offset + p.numel()].view(p.shape)
            for offset, p in zip(self.offsets, self.params, strict=True)
        ]
        present = [(view, p.grad) for view, p in zip(self.views, self.params, strict=True) if p.grad is not None]
        if present:
            torch._foreach_copy_([view for view, _ in present], [grad for _, grad in present])
        for view, param in zip(self.views, self.params, strict=True):
            if param.grad is None:
                view.zero_()
            elif self.wider is not None:
                param.grad = None
        self.work = dist.all_reduce(self.buffer, op=op, async_op=True)

    def wait(self, divide: bool) -> None:
        """Wait for the all-reduce (and divide by the world size where it summed)."""
        self.work.wait()
        if divide:
            self.buffer /= _world()

    def hand_out(self) -> None:
        """Give each parameter of a bucket that is not `wider` its averaged gradient: a view of the
        buffer where the dtypes agree (no copy), else a copy in the parameter's dtype, into its
        existing gradient where it has one (one launch for all)."""
        converted = []  # (gradient, averaged value) pairs of another dtype
        for param, value in zip(self.params, self.views, strict=True):
            if value.dtype == param.dtype:
                param.grad = value
            elif param.grad is None:
                param.grad = value.to(param.dtype)
            else:
                converted.append((param.grad, value))
        if converted:
            torch._foreach_copy_([grad for grad, _ in converted], [value for _, value in converted])
        self._done()

    def cast_out(self, scale: torch.Tensor | None) -> None:
        """Give each parameter of a `wider` bucket its averaged gradient, times ``scale`` (a 0-dim
        tensor) when given: views of one new buffer of their dtype, cast (and scaled) in one pass
        over the bucket."""
        flat = scaled_cast(self.buffer, self.wider, scale)
        for offset, param in zip(self.offsets, self.params, strict=True):
            param.grad = flat[offset : offset + param.numel()].view(param.shape)
        self._done()

    def _done(self) -> None:
        self.ready, self.buffer, self.views, self.work = 0, None, [], None


class BucketedDDP(_DataParallel):
    """Gradients grouped into buckets of at most ``bucket_size_mb`` MB (1e6 bytes), assigned in
    reverse parameter order; one async all-reduce per bucket once all of its gradients are ready.
    A parameter larger than the bucket size gets a bucket of its own."""

    def __init__(self, module: nn.Module, bucket_size_mb: float, reduce_dtype: torch.dtype | None = None) -> None:
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        limit = bucket_size_mb * 1e6
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        current: list[nn.Parameter] = []
        size = 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if current and size + nbytes > limit:
                self._add_bucket(current, reduce_dtype)
                current, size = [], 0
            current.append(param)
            size += nbytes
        if current:
            self._add_bucket(current, reduce_dtype)
        self._params = [p for p in module.parameters() if p.requires_grad]  # in the order the norm sums them
        self._dtypes = [p.dtype for p in self._params]
        super().__init__(module, reduce_dtype)

    def _add_bucket(self, params: list[nn.Parameter], reduce_dtype: torch.dtype | None) -> None:
        bucket = _Bucket(params, reduce_dtype)
        self.buckets.append(bucket)
        for param in params:
            self._bucket_of[id(param)] = bucket

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.launch(self._op)

    def finish_gradient_synchronization(self, max_norm: float | None = None) -> torch.Tensor | None:
        """Launch any bucket some of whose parameters got no gradient, wait for all, average. With
        ``max_norm`` (inf: no limit), also clip as `fastlm train` clips after synchronizing
        (`torch.nn.utils.clip_grad_norm_`; in fp32 for bf16 gradients, `fastlm.optim.clip.grad_norm`):
        scale the gradients by min(1, max_norm / (norm + 1e-6)) and return the norm before, a 0-dim
        tensor. A `wider` bucket (fp32 weights, bf16 wire) is measured on its bf16 buffer, which
        holds the same values, and scaled in its cast back: for the norm and the scale it reads 2
        bytes per gradient, where clipping after the cast reads 8 and writes 4 more."""
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch(self._op)
        for bucket in self.buckets:
            bucket.wait(self._divide)
        held = [bucket for bucket in self.buckets if bucket.wider is None]
        for bucket in held:
            bucket.hand_out()
        casting = [bucket for bucket in self.buckets if bucket.wider is not None]
        if max_norm is None:
            for bucket in casting:
                bucket.cast_out(None)
            return None
        # a casting bucket is measured on its buffer (the same values), the others as handed out
        values = {id(p): p.grad for bucket in held for p in bucket.params}
        values.update((id(p), view) for bucket in casting for p, view in zip(bucket.params, bucket.views, strict=True))
        norm = grad_norm([values[id(p)] for p in self._params], self._dtypes)
        torch.nn.utils.clip_grads_with_norm_([p for bucket in held for p in bucket.params], max_norm, norm)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s coefficient
        for bucket in casting:
            bucket.cast_out(scale)
        return norm


def bf16_reduce_hook(process_group, bucket):  # no annotation: PyTorch checks a string one against a type
    """A PyTorch DistributedDataParallel communication hook: the bucket averaged in bf16 (PyTorch's
    own bf16 hook refuses anything but NCCL on CUDA; this one runs on every backend)."""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def unpack(future: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(future.value()[0])

    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(unpack)
