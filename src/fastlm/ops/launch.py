"""Eager kernel launches with as little Python per call as a launch can have.

`kernel[grid](*args, **constexprs)` on a `@triton.jit` function goes through Triton's dispatcher
on every call: it binds the arguments, reads its settings, builds a string key of the options,
looks the binary up, checks the kernel's globals, then launches. `eager_kernel(kernel)[grid](...)`
takes the same arguments and does that once per specialization: the first call goes through
Triton (which compiles or loads the binary and launches it), later calls with the same
specialization launch the cached binary directly, exactly as Triton's dispatcher does last.

The cache key is finer than Triton's specialization, so a cached binary is never used where
Triton would pick another: each tensor's dtype and address modulo 16 (Triton specializes on 16-byte
alignment), every other runtime argument by value (shapes and strides: one entry per shape, at
most MAX_ENTRIES per kernel), and the constexprs and options by name and value. Runtime arguments
are passed positionally, constexprs and options (num_warps, num_stages) by keyword, as every
fastlm launcher does.

The direct launch uses the launch call of Triton >= 3.4 (`triton.knobs`); with older Triton, under
the interpreter (TRITON_INTERPRET=1), for kernels not called that way or with pre-run hooks, and
in a process started with FASTLM_LAUNCH=triton (to measure one against the other), every call goes
through Triton's dispatcher; so does every later call of a kernel whose direct launch Triton's
launcher rejected. Triton settings that change its binaries (TRITON_DEBUG, instrumentation) are
read when a specialization is first launched: set them before the first call.

Ops launch each kernel through its `launcher`, made once per kernel at import: in eager calls it
gives the kernel's EagerKernel, inside a `torch.library.triton_op` (``traced``) `wrap_triton(kernel)`,
which Inductor turns into a launch from its own generated code.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

import torch
from torch.library import wrap_triton
from triton.runtime.jit import JITFunction

try:  # Triton >= 3.4: launch hooks live in triton.knobs
    from triton import knobs as _knobs
except ImportError:  # older Triton: Triton's dispatcher launches every call
    _knobs = None

# Read once: which launch path this process uses (see the module docstring).
DIRECT_LAUNCH = _knobs is not None and os.environ.get("FASTLM_LAUNCH", "direct") != "triton"
# Cached specializations per kernel; a workload with ever-new shapes starts over past this.
MAX_ENTRIES = 1024


def _specialization(args: tuple) -> tuple:
    """The runtime arguments as a key: one isinstance and at most one method call per argument, the
    whole cost of a direct launch beyond the launch itself. Values other than ints carry their type:
    0, 0.0 and False are equal in Python but compile to different binaries (i32, fp32, i1)."""
    tensor, integer = torch.Tensor, int
    return tuple(
        [
            (a.dtype, a.data_ptr() & 15) if isinstance(a, tensor) else a if a.__class__ is integer else (a.__class__, a)
            for a in args
        ]
    )


def _hook_set(hook) -> bool:
    """A launch hook that would run: Triton 3.4 keeps a callable or None, later ones a HookChain."""
    return hook is not None and bool(getattr(hook, "calls", True))


class EagerKernel:
    """A `@triton.jit` kernel launched through its cached binaries (see the module docstring)."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        self.direct = DIRECT_LAUNCH and isinstance(fn, JITFunction)
        # (device, specialization, constexprs) -> (binary, constexpr values in signature order);
        # None marks a call shape that must go through Triton every time
        self._binaries: dict[tuple, tuple | None] = {}
        if self.direct:
            self._param_names = [p.name for p in fn.params]
            self._runtime_params = sum(1 for p in fn.params if not p.is_constexpr)
            self._all_constexpr_after = all(p.is_constexpr for p in fn.params[self._runtime_params :])
            self._defaults = {p.name: p.default for p in fn.params}
            self._pre_run_hooks = getattr(fn, "pre_run_hooks", ())  # the kernel's own list: later additions show

    def __getitem__(self, grid: tuple[int, ...]):
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args, **kwargs):
        if not self.direct or self._pre_run_hooks:
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, _specialization(args), tuple(kwargs.items()))
        entry = self._binaries.get(key, False)
        if not entry:
            binary = self.fn[grid](*args, **kwargs)  # Triton compiles or finds the binary, and launches
            if entry is False:
                if len(self._binaries) >= MAX_ENTRIES:
                    self._binaries.clear()
                self._binaries[key] = self._entry(binary, args, kwargs)
            return binary
        binary, constexprs = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        full = (*args, *constexprs)
        enter, exit_ = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        if _hook_set(enter) or _hook_set(exit_):  # a profiler listens: give it what Triton gives it
            metadata = binary.launch_metadata(grid, stream, *full)
        else:  # no hook: the launcher calls none (what launch_metadata's LazyDict is for)
            metadata = enter = exit_ = None
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        try:
            binary.run(
                grid[0], grid_1, grid_2, stream, binary.function, binary.packed_metadata, metadata, enter, exit_, *full
            )
        except TypeError:  # a Triton whose launcher takes other arguments (it checks them before launching)
            self.direct = False
            return self.fn[grid](*args, **kwargs)
        return binary

    def _entry(self, binary, args: tuple, kwargs: dict) -> tuple | None:
        """The cache entry for a call just launched through Triton, or None when this call shape
        cannot launch directly (a constexpr passed positionally, a runtime argument by keyword)."""
        if binary is None or len(args) != self._runtime_params or not self._all_constexpr_after:
            return None
        names = self._param_names[len(args) :]
        if any(name not in kwargs and self._defaults[name] is inspect.Parameter.empty for name in names):
            return None
        return binary, tuple(kwargs[name] if name in kwargs else self._defaults[name] for name in names)


_EAGER_KERNELS: dict[int, EagerKernel] = {}  # by id: hashing a JITFunction takes a lock


def eager_kernel(fn) -> EagerKernel:
    """The EagerKernel of ``fn``, made once per kernel: ``eager_kernel(k)[grid](*args, **constexprs)``.
    Kernels are module-level functions that live as long as the process, so their ids stay theirs."""
    kernel = _EAGER_KERNELS.get(id(fn))
    if kernel is None:
        kernel = _EAGER_KERNELS[id(fn)] = EagerKernel(fn)
    return kernel


def launcher(fn: JITFunction) -> Callable[[bool], object]:
    """How an op's launchers launch the `@triton.jit` kernel ``fn``, eager or traced: made once per
    kernel at import (``_launch_forward = launcher(_forward_kernel)``), then called per launch as
    ``_launch_forward(traced)[grid](*args, **constexprs)``. In eager calls it returns fn's
    EagerKernel (looked up once, here), inside a torch.library.triton_op (``traced``)
    ``wrap_triton(fn)``. A closure over ``fn``, so that torch, which reads the source of the
    functions a triton_op calls, finds the kernel through it and keys its compile caches on the
    kernel's source."""
    eager = eager_kernel(fn)

    def launch(traced: bool):
        return wrap_triton(fn) if traced else eager

    return launch
