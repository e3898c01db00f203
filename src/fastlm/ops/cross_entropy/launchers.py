"""Launchers: one per direction, shared by the eager autograd.Functions and the triton_ops; the
plain-PyTorch reference path (fastlm.ops.cross_entropy.reference) where Triton cannot run (CPU without
the interpreter, CPU traces)."""

from __future__ import annotations

import torch

from fastlm.ops.common import cdiv, multiprocessors, runs_triton
from fastlm.ops.cross_entropy.config import _picked_config
from fastlm.ops.cross_entropy.kernels import (
    _cross_entropy_backward_kernel,
    _cross_entropy_forward_kernel,
    _cross_entropy_fused_kernel,
    _scale_rows_kernel,
)
from fastlm.ops.cross_entropy.reference import _reference_forward, _reference_fused, _reference_grad
from fastlm.ops.launch import launcher

_launch_cross_entropy_forward = launcher(_cross_entropy_forward_kernel)
_launch_cross_entropy_backward = launcher(_cross_entropy_backward_kernel)
_launch_cross_entropy_fused = launcher(_cross_entropy_fused_kernel)
_launch_scale_rows = launcher(_scale_rows_kernel)


def _forward(logits, targets, ignore_index, label_smoothing, z_loss, config=None, traced=False, vocab=None):
    """(losses (B,), stats (2, B): each row's m and s), fp32; ``config`` None picks it; ``traced``
    inside the triton_op; ``vocab``: the first columns that are the vocabulary (None: all)."""
    batch, vocab = logits.shape[0], logits.shape[1] if vocab is None else vocab
    if not runs_triton(logits):
        return _reference_forward(logits[:, :vocab], targets, ignore_index, label_smoothing, z_loss)
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    stats = torch.empty((2, batch), device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses, stats
    config = _picked_config(logits, vocab) if config is None else config
    # runtime arguments positionally, constexprs and options by keyword: the direct launch needs that
    _launch_cross_entropy_forward(traced)[(batch,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        targets.stride(0),
        losses,
        stats,
        batch,
        vocab,
        ignore_index,
        label_smoothing,
        z_loss,
        BLOCK_V=config.forward_block,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        num_warps=config.forward_warps,
    )
    return losses, stats


def _backward(logits, targets, stats, grad_losses, ignore_index, label_smoothing, z_loss, config=None, traced=False):
    """dlogits (B, V), contiguous, logits' dtype, recomputing softmax from the saved stats (m, s)."""
    if not runs_triton(logits):
        return _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss)
    batch, vocab = logits.shape
    grad_logits = torch.empty((batch, vocab), device=logits.device, dtype=logits.dtype)
    if batch == 0:
        return grad_logits
    config = _picked_config(logits) if config is None else config
    _launch_cross_entropy_backward(traced)[(batch, cdiv(vocab, config.backward_block))](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        targets.stride(0),
        stats,
        grad_losses,
        grad_losses.stride(0),
        grad_logits,
        batch,
        vocab,
        ignore_index,
        label_smoothing,
        z_loss,
        BLOCK_V=config.backward_block,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        num_warps=config.backward_warps,
    )
    return grad_logits


def _fused(
    logits,
    targets,
    row_scale,
    ignore_index,
    label_smoothing,
    z_loss,
    mean,
    grad=None,
    config=None,
    traced=False,
    vocab=None,
):
    """(losses, dlogits) in one kernel, both multiplied per row by ``row_scale`` (B,) if given, or
    by 1 / n_valid with ``mean``. ``grad`` is the output buffer (may be ``logits``: in place; None:
    a new contiguous one). ``vocab``: the first columns that are the vocabulary (None: all); the
    columns past it are neither read nor written, and ``grad`` comes back whole. A buffer wider
    than the vocabulary, rather than a view of its first columns, is what a traced in-place launch
    needs: Inductor clones a view that a user kernel writes before the launch."""
    if grad is None:
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    batch, vocab = logits.shape[0], logits.shape[1] if vocab is None else vocab
    if not runs_triton(logits):
        columns = slice(0, vocab)
        losses, _ = _reference_fused(
            logits[:, columns], targets, row_scale, ignore_index, label_smoothing, z_loss, mean, grad[:, columns]
        )
        return losses, grad
    losses = torch.empty(batch, device=logits.device, dtype=torch.float32)
    if batch == 0:
        return losses, grad
    config = _picked_config(logits, vocab) if config is None else config
    # a few programs per SM, each striding over the rows; one per row in the interpreter
    programs = batch
    if logits.is_cuda:
        programs = min(batch, config.fused_programs_per_sm * multiprocessors(logits.get_device()))
    _launch_cross_entropy_fused(traced)[(programs,)](
        logits,
        logits.stride(0),
        logits.stride(1),
        targets,
        targets.stride(0),
        losses if row_scale is None else row_scale,
        0 if row_scale is None else row_scale.stride(0),
        losses,
        grad,
        grad.stride(0),
        grad.stride(1),
        batch,
        vocab,
        ignore_index,
        label_smoothing,
        z_loss,
        BLOCK_V=config.fused_block,
        HAS_SMOOTHING=label_smoothing > 0,
        HAS_Z_LOSS=z_loss > 0,
        HAS_ROW_SCALE=row_scale is not None,
        MEAN=mean and row_scale is None,
        COUNT_BLOCK=config.fused_count_block,
        num_warps=config.fused_warps,
    )
    return losses, grad


def _scale_rows(grad, grad_losses, config=None, traced=False):
    """grad[i] *= grad_losses[i] in place (a 0-d grad_losses: one factor for all rows); on the GPU
    free (one scalar load per program) where the factor is 1."""
    if not runs_triton(grad):
        grad.copy_(grad * grad_losses.float().reshape(-1, 1))  # fp32 product, rounded once as the kernel does
        return
    batch, vocab = grad.shape
    if batch == 0:
        return
    config = _picked_config(grad) if config is None else config
    _launch_scale_rows(traced)[(batch, cdiv(vocab, config.backward_block))](
        grad,
        grad.stride(0),
        grad.stride(1),
        grad_losses,
        grad_losses.stride(0) if grad_losses.dim() else 0,
        vocab,
        BLOCK_V=config.backward_block,
        num_warps=config.backward_warps,
    )
