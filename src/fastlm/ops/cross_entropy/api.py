"""The torch.library ops (traced), the autograd.Functions (eager) and the public functions."""

from __future__ import annotations

import torch

from fastlm.ops.common import (
    DTYPES,
    check_dtype,
    check_flag,
    check_integer,
    check_number,
    check_same_device,
    check_tensor,
    may_overlap,
)
from fastlm.ops.cross_entropy.config import _picked_config
from fastlm.ops.cross_entropy.launchers import _backward, _forward, _fused, _scale_rows

REDUCTIONS = ("none", "mean", "sum")
TARGET_DTYPES = (torch.int64, torch.int32)


# ----------------------------------------------------------------------------------------------
# torch.library ops: what torch.compile traces (running the launchers on fake tensors gives the
# output shapes, so no separate fake implementation is needed). They take no config (a schema
# holds tensors and plain values), so they launch the picked one; they check no target range
# (that reads the targets' values: see check_target_range).
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses (B,), stats (2, B): each row's max and log-sum-exp about it), fp32."""
    return _forward(logits, targets, ignore_index, label_smoothing, z_loss, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_backward", mutates_args=())
def _backward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    stats: torch.Tensor,
    grad_losses: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
) -> torch.Tensor:
    """dlogits (B, V) in logits' dtype, recomputing softmax from the saved stats."""
    return _backward(logits, targets, stats, grad_losses, ignore_index, label_smoothing, z_loss, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_fused", mutates_args=())
def _fused_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_scale: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    mean: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, dlogits), scaled per row by ``row_scale`` or, with ``mean``, by 1 / n_valid, so
    that the mean is ``losses.sum()`` and the upstream gradient of every row is exactly 1."""
    return _fused(logits, targets, row_scale, ignore_index, label_smoothing, z_loss, mean, traced=True)


@torch.library.triton_op("fastlm::cross_entropy_scale_rows_", mutates_args=("grad",))
def _scale_rows_op(grad: torch.Tensor, grad_losses: torch.Tensor) -> None:
    """grad[i] *= grad_losses[i] in place: out of place it would have to write all of grad, even
    where every factor is 1."""
    _scale_rows(grad, grad_losses, traced=True)


# ----------------------------------------------------------------------------------------------
# Autograd: the compiled path (register_autograd) and the eager path (autograd.Functions)
# ----------------------------------------------------------------------------------------------


def _forward_setup_context(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing, z_loss = inputs
    _, stats = output
    ctx.save_for_backward(logits, targets, stats)
    ctx.options = (ignore_index, label_smoothing, z_loss)
    ctx.mark_non_differentiable(stats)


def _forward_op_backward(ctx, grad_losses, _grad_stats):
    logits, targets, stats = ctx.saved_tensors
    grad_logits = _backward_op(logits, targets, stats, grad_losses, *ctx.options)
    return grad_logits, None, None, None, None


torch.library.register_autograd(_forward_op, _forward_op_backward, setup_context=_forward_setup_context)


def _fused_setup_context(ctx, inputs, output):
    # The gradient is kept as an attribute, not saved: backward scales it in place, which would
    # trip the saved-tensor version check. It is non-differentiable, so it has no grad_fn and
    # holding it here makes no reference cycle.
    _, grad = output
    ctx.mark_non_differentiable(grad)
    ctx.grad = grad


def _take_fused_grad(ctx) -> torch.Tensor:
    """The gradient computed in the forward; a second backward through the same graph would
    see it already scaled, so it is handed out once."""
    grad = ctx.grad
    if grad is None:
        raise RuntimeError(
            "the fused cross-entropy's backward can run only once per forward (retain_graph=True "
            "reuse is not supported); use fastlm.cross_entropy(..., fused=False) for that"
        )
    ctx.grad = None
    return grad


def _fused_op_backward(ctx, grad_losses, _grad_grad):
    grad = _take_fused_grad(ctx)
    _scale_rows_op(grad, grad_losses)
    return grad, None, None, None, None, None, None


torch.library.register_autograd(_fused_op, _fused_op_backward, setup_context=_fused_setup_context)


# Eager: the same launchers behind plain autograd.Functions (a torch.library call costs tens of
# microseconds of Python, as much as the whole kernel at V=32000). The public function checked
# the inputs; the forwards check the target range (eager only), the backwards check nothing.


class CrossEntropyFunction(torch.autograd.Function):
    """Recompute path: forward saves (logits, targets, stats); backward recomputes softmax.
    ``CrossEntropyFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss, config)``."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, config):
        check_target_range(targets, logits.shape[1], ignore_index)
        config = _picked_config(logits) if config is None else config  # once for both directions
        losses, stats = _forward(logits, targets, ignore_index, label_smoothing, z_loss, config)
        ctx.save_for_backward(logits, targets, stats)
        ctx.options = (ignore_index, label_smoothing, z_loss, config)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        logits, targets, stats = ctx.saved_tensors
        return _backward(logits, targets, stats, grad_losses, *ctx.options), None, None, None, None, None


class CrossEntropyFusedFunction(torch.autograd.Function):
    """Fused path: the forward writes dlogits, the backward hands it out (scaled if needed).
    ``CrossEntropyFusedFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss,
    reduction, inplace, config)``. A "mean" or "sum" is reduced here rather than by a `.sum()`
    after it: one autograd node fewer to record and to run.

    With ``inplace`` the gradient overwrites the logits. Their version counter is bumped, so
    any op that saved the logits for its own backward fails loudly at backward time instead of
    computing with overwritten values.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, z_loss, reduction, inplace, config):
        check_target_range(targets, logits.shape[1], ignore_index)
        config = _picked_config(logits) if config is None else config  # once for both directions
        mean, grad = reduction == "mean", logits if inplace else None
        losses, grad = _fused(logits, targets, None, ignore_index, label_smoothing, z_loss, mean, grad, config)
        if inplace:
            torch.autograd.graph.increment_version(logits)
        ctx.grad = grad  # not saved_tensors: backward scales it in place
        ctx.config = config
        return losses if reduction == "none" else losses.sum()  # a mean's rows came scaled by 1 / n_valid

    @staticmethod
    def backward(ctx, grad_output):
        # grad_output: (B,), or a scalar for a mean / sum. Usually 1 (`loss.backward()`), but that
        # value is on the device: skipping this launch would need a sync, so the kernel tests it.
        grad = _take_fused_grad(ctx)
        _scale_rows(grad, grad_output, ctx.config)
        return grad, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_options(ignore_index, reduction, label_smoothing, z_loss, fused, inplace) -> tuple[int, float, float]:
    """The options of `cross_entropy` (and of `fastlm.layers.CrossEntropyLoss`), one clear error for each
    bad value; returns (ignore_index, label_smoothing, z_loss) as int, float, float."""
    if not (isinstance(reduction, str) and reduction in REDUCTIONS):
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    fused, inplace = check_flag("fused", fused), check_flag("inplace", inplace)
    if inplace and not fused:
        raise ValueError("inplace=True needs fused=True: only the fused path writes the gradient in the forward")
    return (
        check_integer("ignore_index", ignore_index),
        check_number("label_smoothing", label_smoothing, 0.0, 1.0),
        check_number("z_loss", z_loss, 0.0),
    )


def check_inputs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices (the target range: check_target_range)."""
    check_tensor("logits", logits)
    check_tensor("targets", targets)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
    check_dtype("logits", logits, DTYPES)
    check_target_dtype(targets)
    if targets.shape != logits.shape[:1]:
        raise ValueError(
            f"targets must have shape ({logits.shape[0]},) to match logits {tuple(logits.shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        check_same_device(logits=logits, targets=targets)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one class (vocab dimension is 0)")


def check_target_dtype(targets: torch.Tensor) -> None:
    """int64 or int32 class indices; a float, complex or bool tensor gets its own message."""
    if targets.dtype not in TARGET_DTYPES:
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"targets must hold integer class indices (int64), got dtype {targets.dtype}")
        check_dtype("targets", targets, TARGET_DTYPES)


def check_target_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """On CPU, raise ValueError for a target outside [0, vocab) that is not ignore_index.

    Eager only (the autograd.Functions' forwards and the user-loop functions): it reads the
    targets' values, which a trace cannot; a compiled CPU call takes the reference path, where
    torch's own cross-entropy rejects such a target. On CUDA it would cost a device-to-host
    sync per call, so there the kernels write NaN loss and gradient for such a row instead:
    never an out-of-bounds access, never a silently wrong loss.
    """
    if not targets.is_cpu or targets.numel() == 0:
        return
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise ValueError(f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {value}")


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    fused: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, V) against class indices ``targets`` (B,).

    Same values as ``torch.nn.functional.cross_entropy`` (ignore_index, reduction,
    label_smoothing; a mean over zero valid rows is NaN), plus ``z_loss * logsumexp**2`` added per
    non-ignored row. Losses are returned in fp32 whatever the logits' dtype.

    Args:
        ignore_index: an int; rows with this target count as absent.
        fused: when the logits require grad, compute the gradient in the forward pass (one
            kernel reads the logits, writes loss and dlogits) and keep it until backward. Costs
            one (B, V) buffer between forward and backward; ``False`` recomputes the softmax in
            backward from the saved row statistics instead (one more read of the logits).
        inplace: with ``fused``, write the gradient over the logits' storage (saves that
            buffer). The logits are destroyed; they must not be a leaf tensor, nor a view whose
            elements share memory (an expanded tensor); eager only.
    """
    ignore_index, label_smoothing, z_loss = check_options(
        ignore_index, reduction, label_smoothing, z_loss, fused, inplace
    )
    check_inputs(logits, targets)
    compiling = torch.compiler.is_compiling()

    if fused and logits.requires_grad and torch.is_grad_enabled() and logits.shape[0] > 0:
        if inplace:
            if logits.is_leaf:
                raise ValueError(
                    "inplace=True overwrites logits with their gradient, so logits must not be a leaf tensor"
                )
            if may_overlap(logits):
                raise ValueError(
                    f"inplace=True writes the gradient over logits, whose elements share memory "
                    f"(strides {logits.stride()}, as in an expanded view); pass logits.contiguous() or "
                    "inplace=False"
                )
        if not compiling:
            return CrossEntropyFusedFunction.apply(
                logits,
                targets,
                ignore_index,
                label_smoothing,
                z_loss,
                reduction,
                inplace,
                None,
            )
        if inplace:
            raise ValueError("inplace=True works in eager mode only; under torch.compile use inplace=False")
        losses = _fused_op(logits, targets, None, ignore_index, label_smoothing, z_loss, reduction == "mean")[0]
        return losses if reduction == "none" else losses.sum()  # a mean's rows came scaled by 1 / n_valid

    if compiling:
        losses = _forward_op(logits, targets, ignore_index, label_smoothing, z_loss)[0]
    else:
        losses = CrossEntropyFunction.apply(logits, targets, ignore_index, label_smoothing, z_loss, None)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row losses, (B, V) logits and (B,) int64 targets -> (B,) float32 (reduction='none')."""
    check_inputs(logits, targets)
    if torch.compiler.is_compiling():
        return _forward_op(logits, targets, -100, 0.0, 0.0)[0]
    check_target_range(targets, logits.shape[1], -100)
    return _forward(logits, targets, -100, 0.0, 0.0)[0]


def cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """dlogits for per-row losses: (B, V), (B,) int64, (B,) float32 upstream -> (B, V) logits' dtype.

    Needs no saved state: one kernel computes each row's logsumexp and then its gradient.
    """
    check_inputs(logits, targets)
    check_tensor("grad_output", grad_output)
    if not grad_output.is_floating_point():
        raise TypeError(f"grad_output must be a floating-point tensor, got dtype {grad_output.dtype}")
    if grad_output.shape != targets.shape:
        raise ValueError(f"grad_output must have shape {tuple(targets.shape)}, got {tuple(grad_output.shape)}")
    check_same_device(logits=logits, grad_output=grad_output)
    if torch.compiler.is_compiling():
        return _fused_op(logits, targets, grad_output.float(), -100, 0.0, 0.0, False)[1]
    check_target_range(targets, logits.shape[1], -100)
    return _fused(logits, targets, grad_output.float(), -100, 0.0, 0.0, False)[1]
