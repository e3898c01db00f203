"""Fused linear + cross-entropy: the LM loss of ``hidden @ weight.T`` without the (N, V) logits.

    logits = hidden @ weight.T + bias                      (N, V), never held whole
    logits = softcap * tanh(logits / softcap)              (with softcap, as Gemma 2)
    loss   = cross_entropy(logits, targets, ...)           (fastlm.cross_entropy's semantics)

The tokens are processed in chunks of C rows. Per chunk, with G = d loss / d logits_c (C, V):

    logits_c  = hidden_c @ W.T (+ bias)       cuBLAS, in the compute dtype       2 C V d FLOPs
    G         = fused cross-entropy kernel, written over logits_c in place (fastlm.ops.cross_entropy)
    grad_hidden[c]  = G @ W                   cuBLAS                              2 C V d FLOPs
    grad_weight    += G.T @ hidden_c          cuBLAS, accumulated in W's dtype    2 C V d FLOPs
    grad_bias      += G.sum(0)                in fp32

With softcap, G is first taken w.r.t. the capped logits and then multiplied by the chain factor
d/dz [c tanh(z / c)] = 1 - tanh(z / c)^2, which needs tanh kept in a second (C, V) buffer.

For reduction "mean" or "sum" all gradients are computed in the forward and kept until backward,
which only multiplies them by the upstream gradient (free on the GPU where it is 1, as after
``loss.backward()``). A mean scales every row by 1 / n_valid, counted on the device (no host
sync). For reduction "none" the per-row upstream gradient is known only in backward: the forward
computes the losses, the backward recomputes each chunk's logits (8 N V d FLOPs in all, not 6).

Cost (N tokens, V classes, width d, s bytes per compute element, a per weight-gradient element):
    FLOPs      6 N V d, as for the unfused matmul + cross-entropy
    memory     one chunk's logits, C V s (two with softcap), besides the gradients themselves
    traffic    per chunk: the logits written once, read twice and G written by the CE kernel
               (4 C V s); the V x d weight-gradient accumulator read and written (2 V d a), which
               makes the weight-gradient GEMM's intensity C / a FLOP per accumulator byte: chunks
               of 1024-2048 rows put it near or above an H100's ridge (989 TFLOP/s over 3.35 TB/s,
               ~295 FLOP/byte); small chunks make that GEMM memory-bound.
Under autocast with an fp32 weight (a model's master weight) the matmuls run in the autocast
dtype from one V x d copy of the weight, as autocast makes, and the weight gradient accumulates
straight into an fp32 buffer that is returned as the gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastlm.ops.common import (
    DTYPES,
    check_dtype,
    check_integer,
    check_number,
    check_same_device,
    check_tensor,
    device_arch,
)
from fastlm.ops.cross_entropy.api import _scale_rows_op, check_target_dtype, check_target_range
from fastlm.ops.cross_entropy.api import check_options as check_xent_options
from fastlm.ops.cross_entropy.launchers import _forward, _fused, _scale_rows
from fastlm.ops.cross_entropy.reference import cross_entropy_ref

# ----------------------------------------------------------------------------------------------
# Chunk size
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearXentConfig:
    """How the chunked implementation splits the tokens. Frozen, so it can key caches."""

    chunk_rows: int  # tokens per chunk: its logits are (chunk_rows, V) in the compute dtype


# Bytes of one chunk's logits, by device_arch. Big chunks keep the weight-gradient GEMM efficient
# (each chunk reads and writes the whole V x d accumulator); 2**29 is 1/150 of an 80 GB H100:
# 2048 rows at V=128256 in bf16, 1024 at V=256000.
_CHUNK_BYTES = {90: 1 << 29}
DEFAULT_CHUNK_BYTES = 1 << 28  # other GPUs (smaller memories) and the interpreter
CHUNK_ROW_MULTIPLE = 128  # GEMM tiles: M of the logits and K of the weight-gradient GEMM


@functools.cache
def linear_cross_entropy_config(arch: int, dtype: torch.dtype, vocab: int) -> LinearXentConfig:
    """The chunk for ``vocab`` classes computed in ``dtype`` on GPU architecture ``arch``
    (`device_arch`): the most rows, a multiple of 128 and at least 128, whose logits fit the
    architecture's chunk bytes. The width d plays no part: neither the chunk's memory nor the
    weight-gradient GEMM's intensity (C / a FLOP per accumulator byte) depends on it. Cached."""
    rows = _CHUNK_BYTES.get(arch, DEFAULT_CHUNK_BYTES) // (vocab * dtype.itemsize)
    return LinearXentConfig(chunk_rows=max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE))


def _chunk_rows(hidden: torch.Tensor, vocab: int, chunk_rows: int | None) -> int:
    """Rows per chunk: ``chunk_rows``, or the picked config's; at most the rows there are."""
    if chunk_rows is None:
        # a SymInt vocab (a trace with dynamic shapes) cannot key the cache: a trace picks once
        pick = linear_cross_entropy_config if type(vocab) is int else linear_cross_entropy_config.__wrapped__
        chunk_rows = pick(device_arch(hidden.device), hidden.dtype, vocab).chunk_rows
    return max(1, min(chunk_rows, hidden.shape[0]))


# ----------------------------------------------------------------------------------------------
# The chunk loops: shared by the eager autograd.Functions and the triton_ops (``traced``)
# ----------------------------------------------------------------------------------------------


class LossOptions(NamedTuple):
    """The cross-entropy options, in the order the registered ops take them."""

    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(C, d) @ (V', d).T (+ bias) -> (C, V') by cuBLAS, in the inputs' (compute) dtype; V' > V
    where `_row_aligned` appended rows. The kernels take the whole buffer and the vocabulary's
    size: a view of its first V columns that a traced kernel writes would be cloned first."""
    return torch.mm(hidden, weight.t()) if bias is None else torch.addmm(bias, hidden, weight.t())


# Inductor's padding_alignment_bytes (torch._inductor.config): the two must agree for the traced
# logits to keep their layout
LOGITS_ROW_BYTES = 128


def _row_aligned(weight: torch.Tensor, bias: torch.Tensor | None, traced: bool) -> tuple:
    """(weight, bias) for `_logits`: traced (under torch.compile), with zero rows appended up to a
    multiple of 128 bytes of logits per row, so the logits' row stride is one Inductor keeps as is.
    Inductor pads an unaligned row stride of a GPU matmul's output when it is at least 1024
    elements (V = 50257 in bf16: 50304), while the traced kernel launches take the unpadded one, so
    it would copy every chunk of logits into the traced layout, once per kernel argument (about
    0.3 ms per 16384 x 10000 chunk on an H100). The appended rows add at most 63 columns of logits,
    which no kernel reads and no gradient takes (a narrower vocabulary pays them for nothing).
    Eager calls and shapes traced as symbols keep the weight as it is."""
    vocab = weight.shape[0]
    per_row = LOGITS_ROW_BYTES // weight.element_size()
    if not traced or type(vocab) is not int or vocab % per_row == 0:
        return weight, bias
    extra = -vocab % per_row
    return F.pad(weight, (0, 0, 0, extra)), None if bias is None else F.pad(bias, (0, extra))


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, traced: bool) -> None:
    """``out (+)= a @ b`` for a, b in the compute dtype and ``out`` in its own dtype (the weight's:
    fp32 for a master weight), with no temporary of out's size where the device allows.

    Same dtype: cuBLAS adds the fp32 product into out and rounds once. fp32 out from 16-bit inputs
    on CUDA in eager mode: aten's ``addmm(..., out_dtype=float32, out=out)`` does the same into
    the fp32 buffer. A trace cannot take that out= form and Inductor lowers the op to a matmul and
    an add anyway, so traced calls form the fp32 product by ``mm(..., out_dtype=float32)`` and add
    it: one fp32 temporary of out's size per chunk under torch.compile. (Not ``addmm(...,
    out_dtype=)``: its fake-tensor decomposition fails in some PyTorch releases.) CPU has no such
    overload at all: there the product is formed in fp32 from the 16-bit values (exact products,
    as cuBLAS uses; CPU shapes are small). The first chunk overwrites out (in eager mode by
    ``beta=0``, which ignores out's old values, even NaN), so it needs no zero-filled buffer.
    """
    if out.dtype == a.dtype and accumulate:
        torch.addmm(out, a, b, out=out)
    elif out.dtype == a.dtype:  # not addmm with beta 0: a trace would read the buffer's old contents
        torch.mm(a, b, out=out)
    elif out.is_cuda and out.dtype == torch.float32 and not traced:
        torch.addmm(out, a, b, beta=1 if accumulate else 0, out_dtype=torch.float32, out=out)
    elif out.is_cuda and out.dtype == torch.float32:  # a 16-bit matmul with an fp32 result, then the sum
        product = torch.mm(a, b, out_dtype=torch.float32)
        if accumulate:
            out.add_(product)
        else:
            out.copy_(product)
    elif accumulate:
        out.add_(a.float() @ b.float())
    else:
        out.copy_(a.float() @ b.float())


def _chunk_dlogits(hidden, weight, bias, vocab, targets, row_scale, options: LossOptions, traced: bool):
    """(losses, G) of one chunk, both scaled per row by ``row_scale`` (None: 1): G = d loss / d
    logits (C, V) in the compute dtype, written by the fused cross-entropy kernel over the
    logits' own buffer (with softcap over the capped logits', then times 1 - tanh^2). ``weight``
    and ``bias`` may carry rows past ``vocab`` (`_row_aligned`); G then is a view of stride V'."""
    ignore_index, label_smoothing, z_loss, softcap = options
    logits = _logits(hidden, weight, bias)
    if softcap is not None:  # tanh in a buffer of its own, the capped logits over the logits' one
        tanh = torch.div(logits, softcap).tanh_()
        logits = torch.mul(tanh, softcap, out=logits)
    losses, grad = _fused(
        logits, targets, row_scale, ignore_index, label_smoothing, z_loss, False, logits, traced=traced, vocab=vocab
    )
    if softcap is not None:  # grad *= 1 - tanh^2 in place, in fp32 exactly as PyTorch's backward of tanh
        torch.ops.aten.tanh_backward.grad_input(grad, tanh, grad_input=grad)
    return losses, grad[:, :vocab]


def _chunked_losses(hidden, weight, bias, targets, options: LossOptions, chunk_rows, traced=False):
    """Per-row losses (N,) fp32, one chunk of logits at a time; no gradient."""
    rows_total, vocab = hidden.shape[0], weight.shape[0]
    losses = torch.empty(rows_total, device=hidden.device, dtype=torch.float32)
    chunk = _chunk_rows(hidden, vocab, chunk_rows)
    ignore_index, label_smoothing, z_loss, softcap = options
    with torch.autocast(hidden.device.type, enabled=False):  # the matmuls run in hidden's dtype, as cast
        weight, bias = _row_aligned(weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype), traced)
        for start in range(0, rows_total, chunk):
            rows = slice(start, start + chunk)
            logits = _logits(hidden[rows], weight, bias)
            if softcap is not None:
                logits.div_(softcap).tanh_().mul_(softcap)
            losses[rows] = _forward(
                logits, targets[rows], ignore_index, label_smoothing, z_loss, traced=traced, vocab=vocab
            )[0]
            del logits  # before the next chunk's are allocated: one (C, V) buffer alive, not two
    return losses


def _chunked_gradients(hidden, weight, bias, targets, row_scale, needs, options: LossOptions, chunk_rows, traced=False):
    """(losses (N,) fp32, grad_hidden, grad_weight, grad_bias), losses and gradients scaled per row
    by ``row_scale`` (N,) (None: 1). ``needs`` = which of (hidden, weight, bias) want a gradient;
    the others come back as None. grad_hidden is in hidden's (the compute) dtype, grad_weight and
    grad_bias in the weight's and the bias's own dtypes."""
    rows_total, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    need_hidden, need_weight, need_bias = needs
    losses = torch.empty(rows_total, device=device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
    grad_weight = None
    if need_weight:  # the first chunk overwrites it (beta 0): zeros only when there is no chunk
        grad_weight = (torch.empty if rows_total else torch.zeros)(weight.shape, device=device, dtype=weight.dtype)
    grad_bias = torch.zeros(vocab, device=device, dtype=torch.float32) if need_bias else None
    chunk = _chunk_rows(hidden, vocab, chunk_rows)
    with torch.autocast(device.type, enabled=False):  # the matmuls run in hidden's dtype, as cast
        logits_weight, logits_bias = _row_aligned(
            weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype), traced
        )
        compute_weight = logits_weight[:vocab]  # one copy of the weight in the compute dtype, not two
        for start in range(0, rows_total, chunk):
            rows = slice(start, start + chunk)
            scale = None if row_scale is None else row_scale[rows]
            losses[rows], dlogits = _chunk_dlogits(
                hidden[rows], logits_weight, logits_bias, vocab, targets[rows], scale, options, traced
            )
            if need_hidden:
                torch.mm(dlogits, compute_weight, out=grad_hidden[rows])
            if need_weight:
                _matmul_into(grad_weight, dlogits.t(), hidden[rows], start > 0, traced)
            if need_bias:
                grad_bias += dlogits.sum(0, dtype=torch.float32)
            del dlogits  # before the next chunk's logits are allocated: one (C, V) buffer alive, not two
    return losses, grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype)


def _mean_row_scale(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """1 / n_valid for every row, (N,) with stride 0, fp32, computed on the device (inf when no
    target is valid: a mean over nothing is NaN, as in torch)."""
    return (targets != ignore_index).sum().float().reciprocal().expand(targets.shape[0])


def _take_gradients(ctx) -> tuple:
    """The gradients computed in the forward; a second backward through the same graph would see
    them already scaled, so they are handed out once."""
    grads = ctx.grads
    if grads is None:
        raise RuntimeError(
            "linear_cross_entropy's backward can run only once per forward for reduction 'mean' or 'sum' "
            "(retain_graph=True reuse is not supported); use reduction='none' and reduce the losses for that"
        )
    ctx.grads = None
    return grads


def _scale_gradients(grads, grad_loss, scale_rows) -> None:
    """Each gradient times the 0-d upstream gradient, in place, through ``scale_rows`` (the eager
    launcher or the registered op: both skip the memory traffic where the factor is 1 on the GPU)."""
    for grad in grads:
        if grad is not None:
            scale_rows(grad.view(-1, grad.shape[-1]), grad_loss)  # grad_bias (V,) as (1, V)


# ----------------------------------------------------------------------------------------------
# torch.library ops: what torch.compile traces (Inductor sees the matmuls and launches the
# cross-entropy kernels from its own code). Gradients that are not needed come back empty.
# ----------------------------------------------------------------------------------------------


@torch.library.triton_op("fastlm::linear_cross_entropy_losses", mutates_args=())
def _losses_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    chunk_rows: int | None,
) -> torch.Tensor:
    """Per-row losses (N,) fp32; the backward recomputes the logits."""
    options = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    return _chunked_losses(hidden, weight, bias, targets, options, chunk_rows, traced=True)


@torch.library.triton_op("fastlm::linear_cross_entropy_gradients", mutates_args=())
def _gradients_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    chunk_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of the row-scaled losses (0-d), grad_hidden, grad_weight, grad_bias), each gradient
    empty where not needed."""
    options = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    needs = (need_hidden, need_weight, need_bias)
    losses, *grads = _chunked_gradients(
        hidden, weight, bias, targets, row_scale, needs, options, chunk_rows, traced=True
    )
    return losses.sum(), *(hidden.new_empty(0) if grad is None else grad for grad in grads)


def _needs(ctx) -> tuple[bool, bool, bool]:
    """Which of (hidden, weight, bias) want a gradient: inputs 0, 1 and 3 of both ops."""
    return ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]


def _where_needed(grads, needs) -> tuple:
    """The op's gradients, None where not needed (the op returned an empty tensor there)."""
    return tuple(grad if need else None for grad, need in zip(grads, needs, strict=True))


def _losses_setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, *options, chunk_rows = inputs
    ctx.save_for_backward(hidden, weight, targets, bias)
    ctx.options, ctx.chunk_rows = options, chunk_rows


def _losses_op_backward(ctx, grad_losses):
    hidden, weight, targets, bias = ctx.saved_tensors
    needs = _needs(ctx)
    _, *grads = _gradients_op(hidden, weight, targets, bias, grad_losses, *needs, *ctx.options, ctx.chunk_rows)
    grad_hidden, grad_weight, grad_bias = _where_needed(grads, needs)
    return grad_hidden, grad_weight, None, grad_bias, *(None,) * 5


torch.library.register_autograd(_losses_op, _losses_op_backward, setup_context=_losses_setup_context)


def _gradients_setup_context(ctx, inputs, output):
    # The gradients are kept as attributes, not saved: backward scales them in place, which would
    # trip the saved-tensor version check. They are non-differentiable outputs (no grad_fn), so
    # holding them here makes no reference cycle.
    _, *grads = output
    ctx.mark_non_differentiable(*grads)
    ctx.grads = _where_needed(grads, inputs[5:8])  # need_hidden, need_weight, need_bias


def _gradients_op_backward(ctx, grad_loss, *_grad_grads):
    grad_hidden, grad_weight, grad_bias = _take_gradients(ctx)
    _scale_gradients((grad_hidden, grad_weight, grad_bias), grad_loss, _scale_rows_op)
    return grad_hidden, grad_weight, None, grad_bias, *(None,) * 9


torch.library.register_autograd(_gradients_op, _gradients_op_backward, setup_context=_gradients_setup_context)


# Eager: the same loops behind plain autograd.Functions (a torch.library call costs tens of
# microseconds of Python). The public function checked the inputs and the target range.


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-row losses; backward recomputes each chunk's logits and takes the chunk's upstream
    gradients as the row scale. ``LinearCrossEntropyFunction.apply(hidden, weight, targets, bias,
    options, chunk_rows)``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, options, chunk_rows):
        losses = _chunked_losses(hidden, weight, bias, targets, options, chunk_rows)
        ctx.save_for_backward(hidden, weight, targets, bias)
        ctx.options, ctx.chunk_rows = options, chunk_rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets, bias = ctx.saved_tensors
        _, grad_hidden, grad_weight, grad_bias = _chunked_gradients(
            hidden, weight, bias, targets, grad_losses, _needs(ctx), ctx.options, ctx.chunk_rows
        )
        return grad_hidden, grad_weight, None, grad_bias, None, None


class LinearCrossEntropyFusedFunction(torch.autograd.Function):
    """Sum of the row-scaled losses, every gradient computed in the forward; backward scales them by
    the upstream gradient. ``LinearCrossEntropyFusedFunction.apply(hidden, weight, targets, bias,
    row_scale, options, chunk_rows)`` with row_scale (N,) = 1 / n_valid for a mean, None for a sum."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, row_scale, options, chunk_rows):
        losses, *grads = _chunked_gradients(hidden, weight, bias, targets, row_scale, _needs(ctx), options, chunk_rows)
        ctx.grads = grads  # not saved_tensors: backward scales them in place
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        # grad_loss: 0-d, usually 1 (`loss.backward()`), but on the device: the kernel tests it
        grad_hidden, grad_weight, grad_bias = _take_gradients(ctx)
        _scale_gradients((grad_hidden, grad_weight, grad_bias), grad_loss, _scale_rows)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def check_inputs(hidden, weight, targets, bias) -> None:
    """Validate types, shapes, dtypes and devices (the target range: check_target_range)."""
    tensors = {"hidden": hidden, "weight": weight, "targets": targets}
    if bias is not None:
        tensors["bias"] = bias
    for name, tensor in tensors.items():
        check_tensor(name, tensor)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (tokens, d), got shape {tuple(hidden.shape)}")
    rows, width = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(
            f"weight must have shape (vocab, {width}) to match hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    if vocab == 0:
        raise ValueError("weight must have at least one row (the vocabulary is empty)")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(
            f"bias must have shape ({vocab},) to match weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
        )
    if targets.shape != (rows,):
        raise ValueError(
            f"targets must have shape ({rows},) to match hidden {tuple(hidden.shape)}, got {tuple(targets.shape)}"
        )
    for name in ("hidden", "weight", "bias"):
        if name in tensors:
            check_dtype(name, tensors[name], DTYPES)
    check_target_dtype(targets)
    check_same_device(**tensors)


def compute_hidden(hidden, weight, targets, bias, ignore_index: int) -> torch.Tensor:
    """``hidden`` in the compute dtype, after `check_inputs` and (outside a trace) the target range:
    cast to the autocast dtype under ``torch.autocast``; otherwise hidden, weight and bias must
    share a dtype (TypeError naming them)."""
    check_inputs(hidden, weight, targets, bias)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    elif weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        named = {"hidden": hidden, "weight": weight} | ({} if bias is None else {"bias": bias})
        dtypes = ", ".join(f"{name} {str(t.dtype).removeprefix('torch.')}" for name, t in named.items())
        raise TypeError(f"hidden, weight and bias must share one dtype outside torch.autocast, got {dtypes}")
    if not torch.compiler.is_compiling():
        check_target_range(targets, weight.shape[0], ignore_index)
    return hidden


def check_options(reduction, ignore_index, label_smoothing, z_loss, softcap, chunk_rows):
    """The loss options as `cross_entropy` checks them, plus softcap and chunk_rows: returns
    (ignore_index, label_smoothing, z_loss, softcap, chunk_rows) as int, float, float, float or
    None, int or None."""
    ignore_index, label_smoothing, z_loss = check_xent_options(
        ignore_index, reduction, label_smoothing, z_loss, True, False
    )
    softcap = None if softcap is None else check_number("softcap", softcap, positive=True)
    chunk_rows = None if chunk_rows is None else check_integer("chunk_rows", chunk_rows, minimum=1)
    return ignore_index, label_smoothing, z_loss, softcap, chunk_rows


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against ``targets``, without ever
    holding the (N, V) logits.

    hidden (N, d), weight (V, d), bias (V,) or None, targets (N,) class indices. Same values as
    ``fastlm.cross_entropy(F.linear(hidden, weight, bias), targets, ...)`` (ignore_index,
    reduction, label_smoothing and z_loss as there; a mean over zero valid rows is NaN); with
    ``softcap`` the logits are ``softcap * tanh(logits / softcap)`` first. Losses are fp32.

    The matmuls run in hidden's dtype, which the weight and bias must share; under
    ``torch.autocast`` in the autocast dtype, whatever the inputs' dtypes, as ``F.linear`` would.
    The weight and bias gradients come back in their own dtypes (an fp32 weight's is accumulated
    in fp32).

    Args:
        chunk_rows: tokens per chunk (default: about 256-512 MB of logits, a multiple of 128 rows;
            `linear_cross_entropy_config`). Smaller saves memory, larger runs the weight-gradient
            matmul more efficiently.
    """
    ignore_index, label_smoothing, z_loss, softcap, chunk_rows = check_options(
        reduction, ignore_index, label_smoothing, z_loss, softcap, chunk_rows
    )
    hidden = compute_hidden(hidden, weight, targets, bias, ignore_index)
    options = LossOptions(ignore_index, label_smoothing, z_loss, softcap)
    rows = hidden.shape[0]
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    compiling = torch.compiler.is_compiling()

    if any(needs) and reduction != "none" and rows > 0:
        row_scale = _mean_row_scale(targets, ignore_index) if reduction == "mean" else None
        if compiling:
            return _gradients_op(hidden, weight, targets, bias, row_scale, *needs, *options, chunk_rows)[0]
        return LinearCrossEntropyFusedFunction.apply(hidden, weight, targets, bias, row_scale, options, chunk_rows)

    if compiling:
        losses = _losses_op(hidden, weight, targets, bias, *options, chunk_rows)
    elif any(needs):
        losses = LinearCrossEntropyFunction.apply(hidden, weight, targets, bias, options, chunk_rows)
    else:
        losses = _chunked_losses(hidden, weight, bias, targets, options, chunk_rows)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Plain-PyTorch reference with the semantics of ``linear_cross_entropy``, materializing the
    logits, in fp32 (fp64 inputs stay fp64)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return cross_entropy_ref(
        logits, targets, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss
    )
