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
With a bf16 wire and fp32 weights, `finish_gradient_synchronization(max_norm)` also clips: the norm
is read from the bf16 buffers and the scale applied in the one cast back to fp32, where clipping
after synchronizing reads the fp32 gradients twice (norm, scale) and writes them once more.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fastlm.ops.scaled_cast import scaled_cast


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
    """Whether every ``narrow`` value is exactly a ``wide`` one (bf16 in fp32), and they differ."""
    return narrow != wide and torch.promote_types(narrow, wide) == wide


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
        # the parameters' one dtype where it is wider than the wire's: the cast back is exact
        dtypes = {param.dtype for param in params}
        self.wider = next(iter(dtypes)) if len(dtypes) == 1 and _widens(self.dtype, *dtypes) else None
        self.work: dist.Work | None = None

    def launch(self, op: dist.ReduceOp) -> None:
        """Copy the bucket's gradients into a new flat buffer (one launch, cast to the wire dtype on
        the way; zeros for any that backward did not produce) and start their all-reduce."""
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
            param.grad = None  # the bucket holds it now; `hand_out` gives every parameter a new one
        self.work = dist.all_reduce(self.buffer, op=op, async_op=True)

    def wait(self, divide: bool) -> None:
        """Wait for the all-reduce (and divide by the world size where it summed)."""
        self.work.wait()
        if divide:
            self.buffer /= _world()

    def hand_out(self, scale: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Give each parameter its averaged gradient, times ``scale`` (a 0-dim fp32 tensor) when
        given, and return them: views of the buffer where the dtypes agree (no copy), casts where
        they differ. Where every parameter has one dtype wider than the wire's (`wider`: fp32
        weights, bf16 wire), views of one buffer of it, cast and scaled in one pass."""
        if self.wider is not None:
            flat = scaled_cast(self.buffer, self.wider, scale)
            grads = [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params, strict=True)]
        else:
            grads = [v if v.dtype == p.dtype else v.to(p.dtype) for v, p in zip(self.views, self.params, strict=True)]
            if scale is not None:
                torch._foreach_mul_(grads, scale)
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad
        self.ready, self.buffer, self.views, self.work = 0, None, [], None
        return grads


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
        # the order `torch.nn.utils.clip_grad_norm_` sums per-tensor norms in: grouped by dtype in
        # order of first appearance, parameter order within a group
        params = [p for p in module.parameters() if p.requires_grad]
        first = {}
        for param in params:
            first.setdefault(param.dtype, len(first))
        self._clip_order = sorted(params, key=lambda p: first[p.dtype])
        super().__init__(module, reduce_dtype)

    def _total_norm(self, measured: list[tuple[nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        """The 2-norm of the (parameter, gradient values) pairs' values, in fp32: one multi-tensor
        launch per dtype, the per-tensor norms combined in `_clip_order`, so that the result is
        bitwise the norm clipping after synchronizing computes."""
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for param, values in measured:
            by_dtype.setdefault(values.dtype, []).append((param, values))
        norm_of = {}
        for pairs in by_dtype.values():
            norms = torch._foreach_norm([values for _, values in pairs], 2.0, dtype=torch.float32)
            norm_of.update((id(param), n) for (param, _), n in zip(pairs, norms, strict=True))
        return torch.linalg.vector_norm(torch.stack([norm_of[id(param)] for param in self._clip_order]))

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
        ``max_norm``, also clip: the gradients' global 2-norm (a 0-dim fp32 tensor, returned) is
        taken from the averaged buckets, and the gradients leave them scaled by
        min(1, max_norm / (norm + 1e-6)), as `torch.nn.utils.clip_grad_norm_` would scale them
        (inf: measured, not scaled). With a bf16 wire and fp32 weights that reads the bf16 buffers
        for the norm and writes each gradient once, where synchronizing and then clipping reads
        the fp32 gradients twice and writes them twice."""
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch(self._op)
        for bucket in self.buckets:
            bucket.wait(self._divide)
        if max_norm is None:
            for bucket in self.buckets:
                bucket.hand_out()
            return None
        # buckets cast exactly into a wider dtype are measured before they hand out (their buffer
        # holds the same values) and scaled in the cast; the others' gradients as handed out
        casting = [bucket for bucket in self.buckets if bucket.wider is not None]
        held = [pair for b in self.buckets if b.wider is None for pair in zip(b.params, b.hand_out(), strict=True)]
        norm = self._total_norm(held + [pair for b in casting for pair in zip(b.params, b.views, strict=True)])
        scale = None if max_norm == math.inf else torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if scale is not None and held:
            torch._foreach_mul_([grad for _, grad in held], scale)
        for bucket in casting:
            bucket.hand_out(scale)
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
