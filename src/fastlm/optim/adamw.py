"""`AdamW`: torch.optim.AdamW's update of every parameter of a group in one Triton launch.

Per element, at step t (counted per parameter, from 1), as torch.optim.AdamW computes it:

    p <- p * (1 - lr * wd)                                         decoupled weight decay
    m <- m + (1 - beta1) * (g - m)                                 exp_avg (a lerp towards g)
    v <- beta2 * v + (1 - beta2) * g * g                           exp_avg_sq
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Bytes per fp32 parameter: read p, g, m, v (16), write p, m, v (12): 28, the floor of any AdamW
step that keeps fp32 states; about 15 FLOPs, a square root and two divisions per element, so
the step is memory-bound on every GPU.

Parameters stored in bf16 / fp16 (a group with ``param_dtype``): the optimizer keeps an fp32
``master`` copy of each in its state and updates that; the gradient is read in the parameter's
dtype and the parameter is written as the master rounded to it, in the same pass. Bytes per
parameter: read master, g (2), m, v (14), write master, m, v, p (2) (14): 28, as for fp32
parameters, while the training step no longer casts fp32 weights to bf16 in every forward or its
bf16 weight gradients to fp32 in every backward (autocast does both for fp32 weights). Under
bf16 autocast the forward sees the same weights either way (the master rounded to bf16), and
the gradient of a plain matmul is the same bf16 result; gradients summed over several backwards,
or over the chunks of `fastlm.linear_cross_entropy`, are summed in bf16 instead of fp32.

Multi-tensor launch: the launcher writes two int64 tables to the device, built once per layout of
a group's tensors and kept while their addresses stay the same:
    tensors (T, 6): per tensor the addresses of param (its master for a low-precision one), grad,
        exp_avg, exp_avg_sq, its numel, and the low-precision param's (0 without);
    blocks (B, 2): per program the row of its tensor in `tensors` and which BLOCK-wide block of it.
Each program loads its tensor's addresses, turns them into pointers and updates BLOCK elements: one
launch of B = sum over tensors of ceil(numel / BLOCK) programs updates the whole group. Full blocks
load and store without a mask, in 16-byte vectors (every address is 16-byte aligned: the launcher
checks); only the last block of a tensor is masked. The hyper-parameters, bias corrections
included, are scalars computed on the host from the step count, which stays a CPU tensor per
parameter as in torch's default (non-capturable) path, so a step never synchronizes with the GPU.

Under the Triton interpreter (CPU tensors, TRITON_INTERPRET=1) the same kernel runs with the same
tables: the interpreter dereferences the loaded addresses as host memory. On CPU without it, and
for every tensor the kernel does not take (dtypes other than fp32, non-contiguous or unaligned
tensors, complex parameters), torch's own AdamW functional updates the tensors, so semantics
never depend on the path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.optim.adamw import adamw as torch_adamw

from fastlm.ops.common import cdiv, device_arch, runs_triton

# Group keys of torch's AdamW that choose its implementation (they mean nothing here): dropped
# from loaded states, so that a fastlm checkpoint loaded into torch's AdamW runs torch's default.
_TORCH_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
_ONE = torch.ones(())  # what torch adds to CPU step counts: a tensor, which its foreach add takes fastest


# ----------------------------------------------------------------------------------------------
# 1. Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _adamw_update(
    P, G, M, V,  # pointers to the tensor's fp32 param (or master), grad (fp32 or LOW_DTYPE), fp32 exp_avg, exp_avg_sq
    LOW,  # pointer to the LOW_DTYPE param written from the master (unused when LOW_DTYPE is None)
    offsets,  # (BLOCK,) int64 element offsets this program updates
    numel,  # elements of the tensor
    decay, avg_weight, beta2, sq_weight, step_size, bias_correction2_sqrt, eps,  # see _adamw_kernel
    MASKED: tl.constexpr,  # False for a full block: no mask, so loads and stores vectorize
    LOW_DTYPE: tl.constexpr,  # None: fp32 params; else the dtype parameters and gradients are stored in
):  # fmt: skip
    mask = offsets < numel if MASKED else None
    p = tl.load(P + offsets, mask=mask)
    g = tl.load(G + offsets, mask=mask).to(tl.float32)
    m = tl.load(M + offsets, mask=mask)
    v = tl.load(V + offsets, mask=mask)
    p = p * decay
    m = m + avg_weight * (g - m)
    v = v * beta2 + sq_weight * g * g
    # correctly rounded sqrt and divisions, as torch's (Triton's `/` and tl.sqrt are approximate)
    denom = tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)
    tl.store(P + offsets, p, mask=mask)
    tl.store(M + offsets, m, mask=mask)
    tl.store(V + offsets, v, mask=mask)
    if LOW_DTYPE is not None:
        tl.store(LOW + offsets, p.to(LOW_DTYPE), mask=mask)


@triton.jit
def _adamw_kernel(
    TENSORS,  # (T, 6) int64: per tensor, addresses of param (or master), grad, exp_avg, exp_avg_sq (contiguous,
              # 16-byte aligned), its numel, and the LOW_DTYPE param's address (0 for fp32 params)
    BLOCKS,  # (B, 2) int64: per program, its tensor's row in TENSORS and the index of its block in that tensor
    decay,  # 1 - lr * weight_decay
    avg_weight,  # 1 - beta1
    beta2,
    sq_weight,  # 1 - beta2
    step_size,  # lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    eps,
    BLOCK: tl.constexpr,  # elements per program (a power of two)
    LOW_DTYPE: tl.constexpr,  # None: fp32 params and grads; tl.bfloat16 / tl.float16: stored params and grads
):  # fmt: skip
    pid = tl.program_id(0)
    row = TENSORS + 6 * tl.load(BLOCKS + 2 * pid)
    start = tl.load(BLOCKS + 2 * pid + 1) * BLOCK
    grad_dtype: tl.constexpr = tl.float32 if LOW_DTYPE is None else LOW_DTYPE
    # the alignment hint on the pointers is what lets the full blocks use 16-byte accesses
    P = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    G = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(grad_dtype)), 16)
    M = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
    V = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32)), 16)
    numel = tl.load(row + 4)
    LOW = tl.multiple_of(tl.load(row + 5).to(tl.pointer_type(grad_dtype)), 16)
    offsets = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:
        _adamw_update(
            P,
            G,
            M,
            V,
            LOW,
            offsets,
            numel,
            decay,
            avg_weight,
            beta2,
            sq_weight,
            step_size,
            bias_correction2_sqrt,
            eps,
            MASKED=False,
            LOW_DTYPE=LOW_DTYPE,
        )
    else:
        _adamw_update(
            P,
            G,
            M,
            V,
            LOW,
            offsets,
            numel,
            decay,
            avg_weight,
            beta2,
            sq_weight,
            step_size,
            bias_correction2_sqrt,
            eps,
            MASKED=True,
            LOW_DTYPE=LOW_DTYPE,
        )


# ----------------------------------------------------------------------------------------------
# 2. Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdamWConfig:
    """How the kernel covers a group: BLOCK elements per program, num_warps per program."""

    block: int  # a power of two; a tensor of n elements takes ceil(n / block) programs
    num_warps: int


# By device_arch. H100 / H200 (90): 16 fp32 per thread and stream (four 16-byte accesses in flight
# per stream), not swept yet; benchmarks/bench_adamw.py --configs compares others.
_CONFIGS = {90: AdamWConfig(block=4096, num_warps=8)}
DEFAULT_CONFIG = _CONFIGS[90]  # GPUs nobody measured, and the interpreter (0)


@functools.cache
def adamw_config(arch: int, dtype: torch.dtype) -> AdamWConfig:
    """The launch configuration for GPU architecture ``arch`` (`device_arch`: 90 for H100 / H200, 0
    for the interpreter) and parameter ``dtype``; no entry depends on the dtype yet."""
    return _CONFIGS.get(arch, DEFAULT_CONFIG)


# ----------------------------------------------------------------------------------------------
# 3. Launchers: device tables per layout, one launch per (device, step count); torch for the rest
# ----------------------------------------------------------------------------------------------

_Entry = tuple[torch.Tensor, torch.Tensor, dict]  # (param, grad, state) of a parameter with a gradient
# What the kernel stores a low-precision parameter (and reads its gradient) as, by its torch dtype.
LOW_PRECISION = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _updated(param: torch.Tensor, state: dict) -> torch.Tensor:
    """The fp32 tensor the update applies to: the master copy of a low-precision parameter, or the
    parameter itself."""
    return state.get("master", param)


class _Hyperparameters(NamedTuple):
    """A group's hyper-parameters for one step, as Python floats."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of(cls, group: dict) -> _Hyperparameters:
        beta1, beta2 = (_host_float(f"betas[{i}]", beta) for i, beta in enumerate(group["betas"]))
        return cls(_host_float("lr", group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])


class _Tables(NamedTuple):
    tensors: torch.Tensor  # (T, 6) int64 on the tensors' device
    blocks: torch.Tensor  # (B, 2) int64 on the tensors' device


def _build_tables(entries: list[_Entry], block: int, device: torch.device) -> _Tables:
    """The kernel's tables for ``entries``, in one host-to-device copy."""
    rows = torch.tensor(
        [
            [
                _updated(p, s).data_ptr(),
                g.data_ptr(),
                s["exp_avg"].data_ptr(),
                s["exp_avg_sq"].data_ptr(),
                p.numel(),
                p.data_ptr() if "master" in s else 0,
            ]
            for p, g, s in entries
        ],
        dtype=torch.int64,
    )
    counts = cdiv(rows[:, 4], block)  # blocks per tensor; 0 for an empty one
    tensor_of_block = torch.repeat_interleave(torch.arange(len(entries)), counts)
    first_block = torch.cumsum(counts, 0) - counts
    block_in_tensor = torch.arange(len(tensor_of_block)) - first_block[tensor_of_block]
    table = torch.cat([rows.flatten(), torch.stack([tensor_of_block, block_in_tensor], dim=1).flatten()])
    if device.type == "cuda":
        # 16 bytes per program (2 MB for 500M parameters): pinned, so the copy is asynchronous at any
        # size (the driver may wait for the stream to stage a large pageable one); torch's host
        # allocator keeps the buffer until the copy is done
        table = table.pin_memory()
    table = table.to(device, non_blocking=True)
    return _Tables(table[: rows.numel()].view(-1, 6), table[rows.numel() :].view(-1, 2))


def _launch(
    tables: _Tables, config: AdamWConfig, step: float, hyper: _Hyperparameters, low_dtype: torch.dtype | None
) -> None:
    """One launch over every tensor of ``tables``, all at step count ``step``, stored in
    ``low_dtype`` with fp32 masters (None: fp32 parameters)."""
    programs = tables.blocks.shape[0]
    if programs == 0:  # only empty tensors
        return
    lr, beta1, beta2, eps, weight_decay = hyper
    # Triton's dispatcher rather than fastlm.ops.launch.eager_kernel: that keys its cache on the
    # value of every float argument, and the bias corrections change at every step. The
    # dispatcher's extra host cost per launch (benchmarks/results/launch.jsonl) is paid once per
    # group and step.
    _adamw_kernel[(programs,)](
        tables.tensors,
        tables.blocks,
        1.0 - lr * weight_decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
        eps,
        BLOCK=config.block,
        LOW_DTYPE=LOW_PRECISION.get(low_dtype),
        num_warps=config.num_warps,
    )


def _torch_update(entries: list[_Entry], hyper: _Hyperparameters) -> None:
    """torch's AdamW functional with its default implementation for these tensors (foreach on
    CUDA, a loop on CPU); it counts their steps itself. Low-precision parameters: on their masters
    with the gradients in fp32, then rounded back."""
    params, grads, states = (list(column) for column in zip(*entries, strict=True))
    updated = [_updated(p, s) for p, s in zip(params, states, strict=True)]
    grads = [g.float() if "master" in s else g for g, s in zip(grads, states, strict=True)]
    torch_adamw(
        updated,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [],
        [s["step"] for s in states],
        has_complex=any(torch.is_complex(p) for p in params),
        amsgrad=False,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        lr=hyper.lr,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        maximize=False,
    )
    for param, state in zip(params, states, strict=True):
        if "master" in state:
            param.copy_(state["master"])


def _kernel_takes(param: torch.Tensor, grad: torch.Tensor, state: dict) -> bool:
    """Whether the kernel updates this parameter: Triton runs on its device, the tensors are
    contiguous, 16-byte aligned and on one device, and fp32, but for a low-precision parameter and
    its gradient, which share a dtype the kernel stores."""
    if not runs_triton(param):
        return False
    if "master" in state:
        if not (grad.dtype == param.dtype and param.dtype in LOW_PRECISION):
            return False
        fp32 = (state["master"], state["exp_avg"], state["exp_avg_sq"])
    else:
        fp32 = (param, grad, state["exp_avg"], state["exp_avg_sq"])
    return all(t.dtype == torch.float32 for t in fp32) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and t.device == param.device for t in (param, grad, *fp32)
    )


def _layout_key(entries: list[_Entry]) -> tuple:
    """What a plan and its tables depend on: every tensor's address and size (a gradient set to None
    and made again, a loaded state or a parameter's new .data all change it)."""
    return tuple(
        x
        for p, g, s in entries
        for x in (
            p.data_ptr(),
            g.data_ptr(),
            _updated(p, s).data_ptr(),
            s["exp_avg"].data_ptr(),
            s["exp_avg_sq"].data_ptr(),
            p.numel(),
        )
    )


@dataclass
class _Plan:
    """How a group's entries are updated, for one layout of their tensors (`_layout_key`)."""

    by_torch: list[int]  # indices of the entries that torch's AdamW functional updates
    # indices of those the kernel updates, by (device, stored dtype of a low-precision param or None)
    by_kernel: dict[tuple[torch.device, torch.dtype | None], list[int]]
    tables: dict[tuple[int, ...], _Tables]  # by the indices of the entries one launch covers

    @classmethod
    def of(cls, entries: list[_Entry]) -> _Plan:
        plan = cls([], {}, {})
        for i, entry in enumerate(entries):
            if _kernel_takes(*entry):
                param, _, state = entry
                kind = (param.device, param.dtype if "master" in state else None)
                plan.by_kernel.setdefault(kind, []).append(i)
            else:
                plan.by_torch.append(i)
        return plan


def _host_float(name: str, value: float | torch.Tensor) -> float:
    """A hyper-parameter as a Python float: a float, or a one-element CPU tensor (reading a GPU
    tensor would synchronize with the GPU on every step)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            raise ValueError(
                f"{name} must be a float or a one-element CPU tensor, got a tensor of shape "
                f"{tuple(value.shape)} on {value.device}"
            )
        return value.item()
    return float(value)


def _check_group(group: dict) -> None:
    """Raise ValueError for hyper-parameters out of range or features this optimizer lacks."""
    if group.get("amsgrad", False):
        raise ValueError("amsgrad=True is not supported by fastlm.optim.AdamW; use torch.optim.AdamW")
    if group.get("maximize", False):
        raise ValueError("maximize=True is not supported by fastlm.optim.AdamW; use torch.optim.AdamW")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError(
            "a state with decoupled_weight_decay=False (torch.optim.Adam's weight decay) "
            "cannot be loaded into fastlm.optim.AdamW"
        )
    lr = _host_float("lr", group["lr"])
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= _host_float(f"betas[{i}]", beta) < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {float(beta)}")
    if not group["eps"] >= 0.0:
        raise ValueError(f"eps must be >= 0, got {group['eps']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    if group.get("param_dtype") not in (None, *LOW_PRECISION):
        raise ValueError(f"param_dtype must be None, torch.bfloat16 or torch.float16, got {group['param_dtype']!r}")


# ----------------------------------------------------------------------------------------------
# 4. The optimizer
# ----------------------------------------------------------------------------------------------


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (amsgrad=False, maximize=False) updating each param group with one
    Triton launch per device; see the module docstring and docs/optim.md.

    ``lr`` and ``betas`` are floats or one-element CPU tensors. The state per parameter is torch's:
    ``step`` (a CPU float32 tensor), ``exp_avg`` and ``exp_avg_sq``, so state dicts load into
    torch.optim.AdamW and back. ``config`` fixes the kernel's launch configuration (None: picked
    per device by `adamw_config`).

    A param group with ``param_dtype`` (torch.bfloat16 or torch.float16; default None) stores its
    fp32 parameters in that dtype from the optimizer's construction on: each keeps an fp32
    ``master`` copy in its state, which the step updates and rounds back into the parameter (see
    the module docstring; `fastlm.model.transformer.linear_weights` lists a model's matmul weights).
    Parameters already stored in ``param_dtype`` stay as they are, their masters upcast from them.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        config: AdamWConfig | None = None,
    ) -> None:
        self.config = config
        self._plans: dict[tuple, _Plan] = {}  # by the layout of a group's entries (_layout_key)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "param_dtype": None,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)
        low_dtype = self.param_groups[-1].get("param_dtype")
        for param in self.param_groups[-1]["params"] if low_dtype is not None else ():
            if param.dtype == low_dtype:  # already stored low (a bf16 checkpoint): its master starts equal
                self.state[param]["master"] = param.data.float()
            elif param.dtype == torch.float32:
                # the master is the parameter's fp32 storage itself; the parameter gets a rounded copy
                self.state[param]["master"] = param.data
                param.data = param.data.to(low_dtype)
            else:
                raise ValueError(
                    f"param_dtype {low_dtype} needs fp32 parameters (or parameters already in it) "
                    f"to keep masters of, got one of {param.dtype}"
                )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, which casts every floating state tensor to its parameter's dtype, then
        the fp32 master, exp_avg and exp_avg_sq of low-precision parameters as they were saved."""
        saved = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for i, param in zip(ids, params, strict=True):
            if "master" in saved.get(i, {}):
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    self.state[param][key] = saved[i][key].to(param.device, torch.float32, copy=True)

    def __setstate__(self, state: dict) -> None:
        """Also what load_state_dict ends with: checks the loaded groups, drops torch's implementation
        flags, and moves every step count to the CPU as a float32 tensor (torch's fused and
        capturable AdamW keep it on the GPU, older checkpoints as a number)."""
        for group in state["param_groups"]:
            _check_group(group)
        super().__setstate__(state)
        self.__dict__.setdefault("config", None)  # an unpickled optimizer: Optimizer pickles no attributes
        self._plans = {}
        for group in self.param_groups:
            for key in _TORCH_IMPLEMENTATION_KEYS:
                group.pop(key, None)
        for param_state in self.state.values():
            if "step" in param_state:
                param_state["step"] = torch.as_tensor(param_state["step"]).to("cpu", torch.float32)

    @torch.compiler.disable  # runs eagerly: Triton launches from Python, with host-computed scalars
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans: dict[tuple, _Plan] = {}
        for group in self.param_groups:
            entries = self._entries(group)
            if not entries:
                continue
            key = _layout_key(entries)
            plan = plans[key] = self._plans.get(key) or _Plan.of(entries)
            hyper = _Hyperparameters.of(group)
            if plan.by_torch:
                _torch_update([entries[i] for i in plan.by_torch], hyper)
            for (device, low_dtype), members in plan.by_kernel.items():
                self._kernel_update(plan, entries, members, device, low_dtype, hyper)
        self._plans = plans  # plans no group used in this step free their tables
        return loss

    def _entries(self, group: dict) -> list[_Entry]:
        """(param, grad, state) of the group's parameters with a gradient, states created lazily."""
        entries = []
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("fastlm.optim.AdamW does not support sparse gradients; use torch.optim.SparseAdam")
            state = self.state[param]
            if "step" not in state:  # as torch.optim.AdamW: created at the parameter's first gradient
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(_updated(param, state), memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(_updated(param, state), memory_format=torch.preserve_format)
            entries.append((param, grad, state))
        return entries

    def _kernel_update(
        self,
        plan: _Plan,
        entries: list[_Entry],
        members: list[int],
        device: torch.device,
        low_dtype: torch.dtype | None,
        hyper: _Hyperparameters,
    ) -> None:
        """Count a step for ``members`` (indices into ``entries``, all on ``device``, all stored in
        ``low_dtype`` or all fp32) and launch the kernel once per step count: all share it unless some
        lacked gradients on earlier steps."""
        steps = [entries[i][2]["step"] for i in members]
        torch._foreach_add_(steps, _ONE)
        by_step: dict[float, list[int]] = {}
        for i, step in zip(members, steps, strict=True):
            by_step.setdefault(step.item(), []).append(i)
        config = self.config or adamw_config(device_arch(device), torch.float32)
        for step, launched in by_step.items():
            tables = plan.tables.get(tuple(launched))
            if tables is None:
                tables = plan.tables[tuple(launched)] = _build_tables(
                    [entries[i] for i in launched], config.block, device
                )
            _launch(tables, config, step, hyper, low_dtype)
