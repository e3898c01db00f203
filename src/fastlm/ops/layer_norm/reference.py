"""`layer_norm_ref` / `rms_norm_ref`, the plain-PyTorch references the kernels are tested against, and
the launchers' reference path (CPU without the interpreter, and CPU traces), which computes what the
kernels compute, in fp32."""

from __future__ import annotations

import torch


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch in fp32, or float64 for float64 inputs: the reference the kernels are tested against."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = torch.nn.functional.layer_norm(x.to(compute), x.shape[-1:], None, None, eps)
    out = out * weight.to(compute) if weight is not None else out
    return (out + bias.to(compute) if bias is not None else out).to(x.dtype)


def rms_norm_ref(x, weight=None, eps=1e-5, weight_offset=0.0):
    """x / sqrt(mean(x^2) + eps) * (weight + weight_offset) in fp32 (float64 stays float64), in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    out = xc * torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + eps)
    return (out * (weight.to(compute) + weight_offset) if weight is not None else out).to(x.dtype)


def _reference_forward(rows, weight, bias, eps, rms, y_rows, mean, rstd, weight_offset=0.0):
    x = rows.float()
    if rms:
        centered = x
    else:  # about x[row, 0], saving mean - x[row, 0], as the kernels do
        shifted = x - x[:, :1]
        mean.copy_(shifted.mean(dim=-1))
        centered = shifted - mean[:, None]
    rstd.copy_(torch.rsqrt(centered.square().mean(dim=-1) + eps))
    out = centered * rstd[:, None]
    if weight is not None:
        out = out * (weight.float() + weight_offset)
    if bias is not None:
        out = out + bias.float()
    y_rows.copy_(out)


def _reference_backward(dy_rows, rows, weight, mean, rstd, rms, dx_rows, dw, db, weight_offset=0.0):
    x, dy = rows.float(), dy_rows.float()
    x_hat = (x if rms else x - x[:, :1] - mean[:, None]) * rstd[:, None]
    g = dy * (weight.float() + weight_offset) if weight is not None else dy
    out = g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True)
    if not rms:
        out = out - g.mean(dim=-1, keepdim=True)
    dx_rows.copy_(out * rstd[:, None])
    if dw is not None:
        dw.copy_((dy * x_hat).sum(dim=0))
    if db is not None:
        db.copy_(dy.sum(dim=0))
