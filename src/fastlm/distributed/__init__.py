"""Data-parallel training on torch.distributed (NCCL on GPUs, gloo on CPU)."""

from fastlm.distributed.ddp import DDP, BucketedDDP, allreduce_gradients

__all__ = ["DDP", "BucketedDDP", "allreduce_gradients"]
