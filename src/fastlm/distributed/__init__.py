"""Data-parallel training on torch.distributed (NCCL on GPUs, gloo on CPU).

The wrappers and the sharded optimizer (and with them torch) are imported on first use, so that
the parallel modes of `fastlm.distributed.wrappers` are importable without torch.
"""

__all__ = ["DDP", "BucketedDDP", "ShardedOptimizer", "allreduce_gradients"]


def __getattr__(name: str):
    if name == "ShardedOptimizer":
        from fastlm.distributed.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer
    if name in ("DDP", "BucketedDDP", "allreduce_gradients"):
        from fastlm.distributed import ddp

        return getattr(ddp, name)
    raise AttributeError(f"module 'fastlm.distributed' has no attribute {name!r}")
