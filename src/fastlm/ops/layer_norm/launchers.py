"""Launchers: allocate the outputs, pick tiles and programs, and launch the kernels, or take the
reference path (fastlm.ops.layer_norm.reference) where Triton cannot run."""

from __future__ import annotations

import math

import torch

from fastlm.ops.common import as_rows, cdiv, device_arch, runs_triton
from fastlm.ops.launch import launcher
from fastlm.ops.layer_norm.config import (
    _multiprocessors,
    _picked_backward,
    _picked_forward_tiles,
    backward_tiles,
    forward_tiles,
    norm_config,
)
from fastlm.ops.layer_norm.kernels import (
    _norm_backward_kernel,
    _norm_forward_kernel,
    _norm_param_grad_kernel,
    _sum_partials_kernel,
)
from fastlm.ops.layer_norm.reference import _reference_backward, _reference_forward

_launch_norm_forward = launcher(_norm_forward_kernel)
_launch_norm_backward = launcher(_norm_backward_kernel)
_launch_sum_partials = launcher(_sum_partials_kernel)
_launch_norm_param_grad = launcher(_norm_param_grad_kernel)


# Eager ticket counters of the dw / db sums, per (device index, stream): launches on one stream run
# one after another and each leaves its counters at 0, so the next finds them ready. Limits: a
# kernel that dies mid-launch leaves them unusable (as it leaves the CUDA context); a kernel
# launched on a device other than the current one runs on that device's stream, not on the stream
# its counters are keyed by, and could share them with a concurrent launch.
_COUNTERS: dict = {}


def _counters(device: torch.device, n: int, traced: bool) -> torch.Tensor:
    """At least ``n`` int32 counters at 0 for one backward launch on the current stream, which
    leaves them at 0. Traced (Inductor's CUDA graphs replay the zeroing) and while a CUDA graph is
    being captured: fresh zeroed ones, as a graph replays on whatever stream it is given and so
    must own its counters."""
    if traced or (device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()):
        return torch.zeros(n, dtype=torch.int32, device=device)
    if device.type == "cuda":  # the stream the launch goes to: the current device's (as Triton's)
        current = torch.cuda.current_device()
        key = (device.index, current, torch._C._cuda_getCurrentRawStream(current))
    else:
        key = (device.type, None, None)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < n:
        # (a smaller buffer it replaces goes back to the allocator in stream order, after its last use)
        counters = _COUNTERS[key] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return counters


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` for the kernels, with its row stride: a contiguous tensor of any rank as it is (row r
    starts at r * D; no view to make), any other as as_rows' (R, D) view or copy."""
    if t.is_contiguous():
        return t, t.shape[-1]
    rows = as_rows(t)
    return rows, rows.stride(0)


def _row_count(x: torch.Tensor) -> int:
    d = x.shape[-1]
    return x.numel() // d if d else math.prod(x.shape[:-1])


def _forward(
    x,
    weight,
    bias,
    eps: float,
    rms: bool,
    out_dtype: torch.dtype,
    traced: bool = False,
    config=None,
    weight_offset: float = 0.0,
):
    """(y (x's shape, contiguous, out_dtype), mean - x[:, 0] (M,) fp32 or None, rstd (M,) fp32); ``traced``
    inside the triton_op; ``config`` None picks `norm_config`'s; ``weight_offset`` is added to the
    weight (in fp32) wherever it is read."""
    m, d = _row_count(x), x.shape[-1]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, mean, rstd
    if not runs_triton(x):
        _reference_forward(as_rows(x), weight, bias, eps, rms, y.view(m, d), mean, rstd, weight_offset)
        return y, mean, rstd
    if config is None and not traced:
        tiles = _picked_forward_tiles(x.device, d)
    else:  # (traced, the sizes may be symbolic, which no cache takes)
        tiles = forward_tiles(config if config is not None else norm_config(device_arch(x.device)), d)
    rows, stride_x = _rows(x)
    _launch_norm_forward(traced)[(cdiv(m, tiles.block_m),)](
        rows,
        weight if weight is not None else rows,
        bias if bias is not None else rows,
        y,
        mean if mean is not None else rstd,
        rstd,
        stride_x,
        m,
        d,
        eps,
        weight_offset,
        RMS=rms,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_D=tiles.block_d,
        SINGLE_PASS=tiles.single_pass,
        num_warps=tiles.num_warps,
    )
    return y, mean, rstd


def _backward(
    dy,
    x,
    weight,
    mean,
    rstd,
    rms: bool,
    weight_grad: bool,
    bias_grad: bool,
    traced: bool = False,
    config=None,
    weight_offset: float = 0.0,
):
    """(dx (x's shape, contiguous), dw (D,) or None, db (D,) or None): one launch for rows held in
    registers up to fused_sum_max_d wide, else two (dx and partial sums, then dw / db); ``traced``
    inside the triton_op; ``config`` None picks `norm_config`'s; ``weight_offset`` as the forward's
    (dw does not depend on it)."""
    m, d = _row_count(x), x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(d, dtype=weight.dtype, device=x.device) if weight_grad else None
    db = torch.empty(d, dtype=weight.dtype if weight is not None else x.dtype, device=x.device) if bias_grad else None
    if x.numel() == 0 or not runs_triton(x):
        _reference_backward(as_rows(dy), as_rows(x), weight, mean, rstd, rms, dx.view(m, d), dw, db, weight_offset)
        return dx, dw, db
    if config is None and not traced:
        config, tiles, programs = _picked_backward(x.device, d, m, x.element_size(), rms)
    else:
        config = config if config is not None else norm_config(device_arch(x.device))
        tiles, programs = backward_tiles(config, d, m, x.element_size(), rms, _multiprocessors(x.device))
    rows, stride_x = _rows(x)
    dy_rows, stride_dy = _rows(dy)
    mean_or_dummy = mean if mean is not None else rstd
    dw_or_dummy, db_or_dummy = dw if weight_grad else rstd, db if bias_grad else rstd
    # partial rows of dw / db: one per backward program (single pass) or per row group (wide rows);
    # ticket counters for the sums made inside a launch: the single-pass backward's (rows up to
    # fused_sum_max_d wide; one per group of programs and one more) or the wide rows' dw / db
    # kernel's (one per column block)
    grads = weight_grad + bias_grad
    fused_sum = tiles.single_pass and d <= config.fused_sum_max_d
    if tiles.single_pass:
        partial_rows, tickets = programs, cdiv(programs, config.fused_sum_group) + 1 if fused_sum else 0
    else:
        partial_rows, tickets = min(config.param_grad_groups, m), cdiv(d, config.param_grad_block_d)
    partial = torch.empty((grads, partial_rows, d), dtype=torch.float32, device=x.device) if grads else rstd
    counters = _counters(x.device, tickets, traced) if grads and tickets else rstd
    _launch_norm_backward(traced)[(programs,)](
        rows,
        weight if weight is not None else rows,
        dy_rows,
        dx,
        mean_or_dummy,
        rstd,
        partial,
        dw_or_dummy,
        db_or_dummy,
        counters,
        stride_x,
        stride_dy,
        m,
        d,
        weight_offset,
        RMS=rms,
        HAS_WEIGHT=weight is not None,
        WEIGHT_GRAD=weight_grad,
        BIAS_GRAD=bias_grad,
        BLOCK_M=tiles.block_m,
        BLOCK_D=tiles.block_d,
        SINGLE_PASS=tiles.single_pass,
        FUSED_SUM=fused_sum,
        SUM_GROUP=config.fused_sum_group,
        SUM_BLOCK_D=config.fused_sum_block_d,
        num_warps=tiles.num_warps,
    )
    if grads and tiles.single_pass and not fused_sum:
        _launch_sum_partials(traced)[(cdiv(d, config.sum_block_d),)](
            partial,
            dw_or_dummy,
            db_or_dummy,
            programs,
            d,
            WEIGHT_GRAD=weight_grad,
            BIAS_GRAD=bias_grad,
            BLOCK_P=config.sum_block_p,
            BLOCK_D=config.sum_block_d,
            num_warps=4,
        )
    if grads and not tiles.single_pass:
        _launch_norm_param_grad(traced)[(cdiv(d, config.param_grad_block_d), partial_rows)](
            rows,
            dy_rows,
            mean_or_dummy,
            rstd,
            partial,
            dw_or_dummy,
            db_or_dummy,
            counters,
            stride_x,
            stride_dy,
            m,
            d,
            cdiv(m, partial_rows),
            RMS=rms,
            WEIGHT_GRAD=weight_grad,
            BIAS_GRAD=bias_grad,
            BLOCK_M=config.param_grad_block_m,
            BLOCK_D=config.param_grad_block_d,
            SUM_GROUP=config.fused_sum_group,
            num_warps=config.param_grad_warps,
        )
    return dx, dw, db
