"""Data-parallel training on torch.distributed (NCCL on GPUs, gloo on CPU)."""

from fastlm.distributed.ddp import DDP, BucketedDDP, allreduce_gradients
from fastlm.distributed.sharded_optimizer import ShardedOptimizer

__all__ = ["DDP", "BucketedDDP", "ShardedOptimizer", "allreduce_gradients"]
