"""Data-parallel wrappers on 2 gloo ranks (CPU): replicas stay equal to single-process training."""

import copy
import gc
import itertools
import math
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastlm.distributed import DDP, BucketedDDP
from fastlm.distributed.launch import spawn
from fastlm.distributed.wrappers import ParallelSpec, wrap
from fastlm.optim.clip import grad_norm

from . import ranks

WORLD = 2
CPU = torch.device("cpu")
SPECS = {
    "naive": ParallelSpec("naive"),
    "flat": ParallelSpec("flat"),
    "ddp": ParallelSpec("ddp"),
    "bucketed-tiny": ParallelSpec("bucketed", 0.0001),  # a bucket per parameter
    "bucketed-large": ParallelSpec("bucketed", 100),  # one bucket for everything
}


class TiedModel(nn.Module):
    """Embedding tied to the output layer, one frozen layer, one parameter unused by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.zeros(3))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, tokens):
        x = self.frozen(torch.relu(self.hidden(self.embed(tokens)))) * self.scale
        return x @ self.embed.weight.T  # tied output projection


def _train_matches_single_process(rank: int, spec: ParallelSpec, accumulate: bool) -> None:
    after_backward = spec.mode in ("naive", "flat")  # these do not broadcast the weights
    torch.manual_seed(rank)  # different initial weights per rank: the wrapper must broadcast rank 0's
    model = TiedModel()
    if after_backward:
        torch.manual_seed(0)
        model = TiedModel()  # start equal
    parallel = wrap(model, spec, CPU)
    wrapped = parallel.module
    torch.manual_seed(0)
    reference = TiedModel()
    if not after_backward:
        reference.load_state_dict(model.state_dict())  # rank 0's weights, broadcast
    data = torch.randint(0, 11, (3, 2 * WORLD, 5), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    reference_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        batch = data[step]  # (2 * WORLD, 5): each rank takes its half
        mine = batch[2 * rank : 2 * rank + 2]
        if accumulate and not after_backward:
            with wrapped.no_sync():
                wrapped(mine[:1]).square().mean().mul(0.5).backward()
            wrapped(mine[1:]).square().mean().mul(0.5).backward()
        else:
            wrapped(mine).square().mean().backward()
        parallel.synchronize()
        optimizer.step()
        optimizer.zero_grad()
        reference(batch).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("variant", SPECS)
def test_training_matches_single_process(variant):
    ranks.run(_train_matches_single_process, SPECS[variant], False)


@pytest.mark.parametrize("variant", ["ddp", "bucketed-tiny"])
def test_no_sync_accumulates_then_syncs(variant):
    ranks.run(_train_matches_single_process, SPECS[variant], True)


def _mismatch(rank: int, cls_name: str) -> None:
    model = nn.Linear(4, 4 + rank)  # rank 1 has other shapes
    cls = DDP if cls_name == "DDP" else (lambda m: BucketedDDP(m, 1))
    with pytest.raises(ValueError, match="rank 1's model differs from rank 0's"):
        cls(model)


@pytest.mark.parametrize("cls_name", ["DDP", "BucketedDDP"])
def test_models_that_differ_across_ranks_are_rejected(cls_name):
    ranks.run(_mismatch, cls_name)


def _buckets(rank: int) -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100), nn.Linear(100, 10))
    wrapped = BucketedDDP(model, bucket_size_mb=0.05)  # 50 kB
    sizes = [[tuple(p.shape) for p in bucket.params] for bucket in wrapped.buckets]
    # reverse order, the last layer first: 40 + 4000 + 400 + 40000 + 400 bytes fit in 50 kB, the first
    # layer's 40 kB weight does not
    assert sizes == [[(10,), (10, 100), (100,), (100, 100), (100,)], [(100, 100)]]
    assert all(sum(p.numel() * 4 for p in b.params) <= 50_000 or len(b.params) == 1 for b in wrapped.buckets)
    assert wrapped.module is model
    copy.deepcopy(model)  # the wrapper leaves the module an ordinary module


def test_buckets_follow_reverse_parameter_order():
    ranks.run(_buckets)


class MixedDtypes(nn.Module):
    """An fp32 linear layer and a bf16 scale, of sizes that pack unaligned (3, 3, 12): one bucket
    holds all."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))

    def forward(self, x):
        return self.linear(x) * self.scale.float()


def _averaged_gradients(rank: int, make_wrapper, backend: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else CPU
    torch.manual_seed(0)
    model = MixedDtypes().to(device)
    reference = copy.deepcopy(model)
    wrapped = make_wrapper(model)
    data = torch.randn(WORLD, 3, 4, generator=torch.Generator().manual_seed(1)).to(device)
    wrapped(data[rank]).square().sum().backward()
    wrapped.finish_gradient_synchronization()
    local = []  # each rank's own gradients, computed here for both
    for batch in data:
        reference.zero_grad(set_to_none=True)
        reference(batch).square().sum().backward()
        local.append([p.grad.float() for p in reference.parameters()])
    for (name, param), *grads in zip(model.named_parameters(), *local, strict=True):
        assert param.grad.dtype == param.dtype, name
        # averaged in fp32 (a bucket's promoted dtype; ddp reduces each gradient in its own, and the
        # bf16 sum of two bf16 gradients, halved, is the fp32 mean rounded once), then rounded
        torch.testing.assert_close(param.grad, (sum(grads) / WORLD).to(param.dtype), msg=name)
    if isinstance(wrapped, BucketedDDP):  # fp32 gradients: aligned views of the bucket's reduced buffer
        weight, bias = model.linear.weight.grad, model.linear.bias.grad
        assert weight.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
        assert weight.data_ptr() % 16 == 0 and bias.data_ptr() % 16 == 0


def _one_bucket(model):
    return BucketedDDP(model, bucket_size_mb=100)  # fp32 and bf16 parameters in one bucket


@pytest.mark.parametrize("make_wrapper", [DDP, _one_bucket], ids=["ddp", "bucketed"])
def test_mixed_dtypes_average_and_buckets_hand_out_aligned_views(make_wrapper):
    ranks.run(_averaged_gradients, make_wrapper, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
@pytest.mark.parametrize("make_wrapper", [DDP, _one_bucket], ids=["ddp", "bucketed"])
def test_gpu_nccl_averages_in_the_all_reduce(make_wrapper):
    """NCCL averages in the reduction itself (no division after it): the same means as gloo's sums."""
    spawn(_averaged_gradients, WORLD, make_wrapper, "nccl", backend="nccl", timeout_s=120)


def _clip_after(model: nn.Module, max_norm: float) -> torch.Tensor:
    """What `fastlm train` does after synchronizing: PyTorch's clip for gradients of one dtype, the
    fp32 norm (`grad_norm`) for mixed ones."""
    params = [p for p in model.parameters() if p.grad is not None]
    if len({p.dtype for p in params}) == 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = grad_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _clipped_on_the_way_out(rank: int) -> None:
    """finish_gradient_synchronization(max_norm) leaves the gradients and returns the norm that
    synchronizing and then clipping gives, bitwise, on every path out of a bucket: views of the
    buffer (fp32 wire), one cast of a bf16 buffer into fp32 gradients (bf16 wire), buckets of
    mixed dtypes; one bucket or one per parameter; tied, frozen and unused parameters; after a
    micro-batch accumulated under no_sync."""
    tokens = torch.randint(0, 11, (WORLD, 2, 5), generator=torch.Generator().manual_seed(1))
    inputs = torch.randn(WORLD, 3, 4, generator=torch.Generator().manual_seed(1))
    models = {"tied fp32": (TiedModel, tokens), "mixed dtypes": (MixedDtypes, inputs)}
    for (name, (make, data)), reduce_dtype, bucket_mb, max_norm in itertools.product(
        models.items(), (None, torch.bfloat16), (0.0001, 100), (0.05, 1e6, math.inf)
    ):
        case = f"{name}, reduce {reduce_dtype}, {bucket_mb} MB buckets, max_norm {max_norm}"
        torch.manual_seed(0)
        model = make()
        reference = copy.deepcopy(model)
        fused, plain = (BucketedDDP(m, bucket_mb, reduce_dtype) for m in (model, reference))
        for wrapped in (fused, plain):
            with wrapped.no_sync():
                wrapped(data[rank]).square().sum().backward()
            wrapped(data[rank].flip(0)).square().sum().backward()
        for bucket in fused.buckets:  # a launched bucket that casts back has freed the old gradients
            if bucket.work is not None and bucket.wider is not None:
                assert all(p.grad is None for p in bucket.params), case
        norm = fused.finish_gradient_synchronization(max_norm)
        plain.finish_gradient_synchronization()
        expected = _clip_after(reference, max_norm)
        assert norm.dtype == torch.float32 and norm.dim() == 0, case
        assert torch.equal(norm, expected), f"{case}: norm {norm} != {expected}"
        for (param_name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, f"{case}: {param_name}"
                continue
            assert p.grad.dtype == p.dtype and torch.equal(p.grad, q.grad), f"{case}: {param_name}"
    # fp32 weights alone over a bf16 wire: every gradient a view of one fp32 buffer cast in one pass
    model = nn.Linear(4, 3)
    wrapped = BucketedDDP(model, bucket_size_mb=100, reduce_dtype=torch.bfloat16)
    assert wrapped.buckets[0].wider == torch.float32
    wrapped(inputs[rank]).square().sum().backward()
    wrapped.finish_gradient_synchronization(0.05)
    weight, bias = model.weight.grad, model.bias.grad
    assert weight.dtype == torch.float32
    assert weight.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()


def _fp64_weights_stay_fp64(rank: int) -> None:
    model = nn.Linear(4, 3).double()
    wrapped = BucketedDDP(model, bucket_size_mb=100, reduce_dtype=torch.bfloat16)
    wrapped(torch.randn(3, 4, dtype=torch.float64)).square().sum().backward()
    norm = wrapped.finish_gradient_synchronization(0.05)
    assert model.weight.grad.dtype == torch.float64 and norm.dtype == torch.float64


def test_fp64_weights_over_a_bf16_wire():
    ranks.run(_fp64_weights_stay_fp64)


def test_clipping_on_the_way_out_of_the_buckets_equals_clipping_after():
    ranks.run(_clipped_on_the_way_out)


def _dropped_wrappers_free_their_model(rank: int) -> None:
    for make in (DDP, lambda m: BucketedDDP(m, 1)):
        model = nn.Linear(4, 4)
        wrapped = make(model)
        wrapped(torch.randn(2, 4)).sum().backward()
        wrapped.finish_gradient_synchronization()
        weight = weakref.ref(model.weight)
        del wrapped, model
        gc.collect()
        assert weight() is None, "the wrapper's hooks kept the model alive"


def test_dropped_wrappers_free_their_model():
    ranks.run(_dropped_wrappers_free_their_model)


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        DDP(nn.Linear(2, 2))


def _dies(rank: int) -> None:
    if rank == 1:
        os._exit(0)  # a rank that disappears without a word
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(4))
    os._exit(0)  # the check passed; there is no peer left to tear down with


def test_a_dead_rank_makes_the_others_fail_not_hang():
    spawn(_dies, WORLD, backend="gloo", timeout_s=60)  # new processes: a rank ends its own
