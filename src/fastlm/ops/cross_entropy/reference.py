"""`cross_entropy_ref`, the plain-PyTorch reference, and the launchers' reference-path equivalents
(CPU without the interpreter, and CPU traces): same outputs, computed in fp32 by plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_ref(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Plain-PyTorch reference with the semantics of ``cross_entropy``, in fp32 (fp64 stays fp64)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(
        x, targets.long(), ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = targets != ignore_index
    if z_loss > 0:
        losses = losses + torch.where(valid, z_loss * torch.logsumexp(x, dim=-1) ** 2, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()


def _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss):
    losses = cross_entropy_ref(
        logits, targets, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing, z_loss=z_loss
    )
    x = logits.float()
    row_max = x.amax(dim=-1)
    return losses.float(), torch.stack([row_max, torch.logsumexp(x - row_max[:, None], dim=-1)])


def _reference_grad(logits, targets, grad_losses, ignore_index, label_smoothing, z_loss):
    """The gradient formula (fastlm.ops.cross_entropy.kernels) in fp32 PyTorch (autograd is off inside ops), times
    ``grad_losses`` (B,) unless None; p from torch.softmax, which shifts by the row max first."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    valid = targets != ignore_index
    onehot = F.one_hot(torch.where(valid, targets, 0).long(), x.shape[1]).float()
    grad = torch.softmax(x, dim=-1) * (1.0 + 2.0 * z_loss * lse) - (1.0 - label_smoothing) * onehot
    grad = grad - label_smoothing / x.shape[1]
    if grad_losses is not None:
        grad = grad * grad_losses.float()[:, None]
    return torch.where(valid[:, None], grad, 0.0).to(logits.dtype)


def _reference_fused(logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, grad):
    if row_scale is None and mean:
        row_scale = (1.0 / (targets != ignore_index).sum().float()).expand(targets.shape[0])
    losses, _ = _reference_forward(logits, targets, ignore_index, label_smoothing, z_loss)
    grad.copy_(_reference_grad(logits, targets, row_scale, ignore_index, label_smoothing, z_loss))
    return (losses if row_scale is None else losses * row_scale), grad
