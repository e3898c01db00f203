"""Named ranges around parts of a step ("forward", "attention/softmax", ...), visible both to
torch.profiler (as record_function events) and to Nsight Systems (as NVTX ranges).

Ranges cost a few microseconds each, so they are off unless a profiling tool turns them on with
`annotations()`; `annotate(name)` is then a no-op context everywhere else (and under torch.compile).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_enabled = False


@contextlib.contextmanager
def annotations(enabled: bool = True) -> Iterator[None]:
    """Turn `annotate` ranges on (or off) for the duration of the block."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


@contextlib.contextmanager
def _range(name: str) -> Iterator[None]:
    nvtx = torch.cuda.is_available()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()


def annotate(name: str) -> contextlib.AbstractContextManager:
    """A profiler + NVTX range named ``name`` while `annotations()` is on; otherwise nothing."""
    return _range(name) if _enabled else contextlib.nullcontext()
