"""The torch.library ops (traced), the autograd.Function (eager) and the public functions."""

from __future__ import annotations

import torch

from fastlm.ops.common import DTYPES, check_dtype, check_number, check_optional_tensor, check_same_device, check_tensor
from fastlm.ops.layer_norm.launchers import _backward, _forward

# ----------------------------------------------------------------------------------------------
# torch.library ops (what torch.compile traces) and autograd
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::norm_forward", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    out_dtype: torch.dtype,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean - x[:, 0], rstd); that mean is an empty tensor for RMSNorm (ops cannot return None)."""
    y, mean, rstd = _forward(x, weight, bias, eps, rms, out_dtype, traced=True, weight_offset=weight_offset)
    return y, (rstd.new_empty(0) if mean is None else mean), rstd


@torch.library.triton_op("fastlm::norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    weight_grad: bool,
    bias_grad: bool,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); dw / db are empty tensors when not requested."""
    mean = None if rms else mean
    dx, dw, db = _backward(
        dy, x, weight, mean, rstd, rms, weight_grad, bias_grad, traced=True, weight_offset=weight_offset
    )
    empty = rstd.new_empty(0)
    return dx, (empty if dw is None else dw), (empty if db is None else db)


def _op_setup_context(ctx, inputs, output):
    x, weight, bias, eps, rms, _, weight_offset = inputs  # torch fills in the defaults
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.rms, ctx.weight_offset = rms, weight_offset
    ctx.mark_non_differentiable(mean, rstd)


def _op_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dx, dw, db = _backward_op(dy, x, weight, mean, rstd, ctx.rms, weight_grad, bias_grad, ctx.weight_offset)
    return dx, (dw if weight_grad else None), (db if bias_grad else None), None, None, None, None


torch.library.register_autograd(_forward_op, _op_backward, setup_context=_op_setup_context)


# Eager: the same launchers behind a plain autograd.Function (a torch.library call costs tens of
# microseconds of Python, as much as the kernel on small rows).


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, out_dtype, weight_offset, config):
        y, mean, rstd = _forward(x, weight, bias, eps, rms, out_dtype, config=config, weight_offset=weight_offset)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.weight_offset, ctx.config = rms, weight_offset, config
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _backward(
            dy,
            x,
            weight,
            mean,
            rstd,
            ctx.rms,
            weight_grad,
            bias_grad,
            config=ctx.config,
            weight_offset=ctx.weight_offset,
        )
        return dx, dw, db, None, None, None, None, None


def _apply(
    x, weight, bias, eps: float, rms: bool, out_dtype: torch.dtype | None, config=None, weight_offset: float = 0.0
) -> torch.Tensor:
    """The norm through autograd; ``config`` (eager only; None picks `norm_config`'s) for tests and tuning."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        return _forward_op(x, weight, bias, eps, rms, out_dtype, weight_offset)[0]
    return NormFunction.apply(x, weight, bias, eps, rms, out_dtype, weight_offset, config)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps, out_dtype: torch.dtype | None = None
) -> float:
    """One clear error for each bad argument; returns eps as a float (an int eps would compile a
    kernel of its own)."""
    check_tensor("x", x)
    check_optional_tensor("weight", weight)
    check_optional_tensor("bias", bias)
    eps = check_number("eps", eps, 0.0)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the normalized one)")
    check_dtype("x", x, DTYPES)
    if out_dtype is not None and out_dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"out_dtype must be one of ({names}) or None, got {out_dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if param.dim() != 1 or param.shape[0] != x.shape[-1]:
            raise ValueError(
                f"{name} must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, got {tuple(param.shape)}"
            )
        check_dtype(name, param, DTYPES)
        if param.device != x.device:
            check_same_device(x=x, **{name: param})
    return eps


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any rank); statistics in fp32, output in ``out_dtype``
    (default: x's dtype). Same values as ``torch.nn.functional.layer_norm(x, x.shape[-1:], weight,
    bias, eps).to(out_dtype)``, rounded once: an fp32 x normalized straight into bf16 for the
    matmul that follows skips a full-width fp32 write and the cast pass."""
    eps = check_inputs(x, weight, bias, eps, out_dtype)
    return _apply(x, weight, bias, eps, False, out_dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * (weight + weight_offset), computed in
    fp32, returned in ``out_dtype`` (default: x's dtype). Same values as
    ``torch.nn.functional.rms_norm(x, x.shape[-1:], weight.float() + weight_offset, eps).to(out_dtype)``;
    ``weight_offset`` 1 is Gemma's ``(1 + weight)`` RMSNorm (the weight's gradient is unchanged: the
    offset is added inside the kernels, in fp32, never to the parameter)."""
    eps = check_inputs(x, weight, None, eps, out_dtype)
    weight_offset = check_number("weight_offset", weight_offset)
    if weight_offset != 0.0 and weight is None:
        raise ValueError("weight_offset needs a weight: with weight None there is nothing to offset")
    return _apply(x, weight, None, eps, True, out_dtype, weight_offset=weight_offset)
