"""Timing of one callable: warm-up excluded, median with p20/p80.

CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before every call, warm-up and
repetition counts chosen from a time budget), of the call itself or of its CUDA-graph replay
(``measure_graph_replay``: kernel time without host dispatch). CPU: wall clock (``perf_counter``)
around runs of calls, which are synchronous there, long enough to resolve one call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

REP_MS = 400.0  # time budget of the timed calls (CUDA: do_bench's; CPU: before stopping at >= 5 samples)
CPU_SAMPLE_MS = 20.0  # CPU: the least time one sample spans (calls back to back), >> a scheduler tick


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup_ms: float = 100.0,
    rep_ms: float = REP_MS,
    grad_to_none: Sequence[torch.Tensor] = (),
) -> Timing:
    """Time ``fn`` on ``device``; tensors in ``grad_to_none`` get ``.grad = None`` before each call
    (outside the timed region) so that backward passes assign gradients instead of accumulating."""
    fn()  # first call: compilation, autotuning, allocator growth
    if device.type == "cuda":
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none) or None, quantiles=[0.5, 0.2, 0.8]
        )
        return Timing(median, p20, p80)
    return _measure_cpu(fn, rep_ms, grad_to_none)


def drop_grads(tensors: Sequence[torch.Tensor]) -> None:
    """``.grad = None`` on each, so that the next backward assigns gradients instead of adding."""
    for tensor in tensors:
        tensor.grad = None


def peak_backward_memory(loss: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor]) -> dict:
    """CUDA: the peak allocated during one ``loss().backward()`` minus what was allocated just before
    (the inputs, the caching allocator's other live blocks excluded), in GiB: ``peak_gib`` with the
    gradients of ``leaves``, which remain allocated after the step, ``peak_excluding_grads_gib``
    without them (what the loss itself costs). The leaves' gradients are dropped before and after."""
    drop_grads(leaves)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    gradients = sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    drop_grads(leaves)
    return {"peak_gib": peak / 2**30, "peak_excluding_grads_gib": (peak - gradients) / 2**30}


def measure_graph_replay(fn: Callable[[], object], device: torch.device, leaves: Sequence[torch.Tensor] = ()) -> Timing:
    """Time ``fn`` captured once into a CUDA graph and replayed: the GPU time of its kernels with the
    host's dispatch (Python, autograd, launches) taken out, for every implementation alike. The
    replays run under ``measure`` (L2 flushed before each); one graph launch costs the host a few
    microseconds, less than the flush it hides behind. ``leaves`` lose their gradients before the
    warm-up calls and the capture, so a captured backward writes fresh gradients in the graph's
    memory rather than accumulating, and again at the end, so none points into that memory. CUDA
    only (ValueError otherwise); an error of the capture propagates, with the current stream
    restored."""
    if device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    with torch.cuda.stream(side):  # warm-up off the capture stream: compilation, autotuning, workspaces
        for _ in range(3):
            drop_grads(leaves)
            fn()
    caller.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        drop_grads(leaves)
        with torch.cuda.graph(graph):
            fn()
        return measure(graph.replay, device)
    finally:
        torch.cuda.set_stream(caller)  # a failed capture can end without restoring it
        drop_grads(leaves)
        del graph


def _measure_cpu(fn, rep_ms, grad_to_none, clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Wall-clock samples of ``fn``, each of as many calls back to back as take CPU_SAMPLE_MS (found by
    doubling), divided by their number: a call shorter than the clock's or the scheduler's tick (a
    thread that waits for a shared core wakes on a tick of several ms) is then still resolved."""
    calls = 1
    while True:
        elapsed_ms = _time_calls(fn, calls, grad_to_none, clock)
        if elapsed_ms >= CPU_SAMPLE_MS or calls >= 2**20:
            break
        calls *= 2
    samples: list[float] = []
    deadline = clock() + rep_ms / 1e3
    while len(samples) < 5 or (clock() < deadline and len(samples) < 1000):
        samples.append(_time_calls(fn, calls, grad_to_none, clock) / calls)
    return _summarize(samples)


def _time_calls(fn, calls: int, grad_to_none, clock: Callable[[], float]) -> float:
    """Milliseconds of ``calls`` calls of ``fn``, each after dropping the gradients of ``grad_to_none``."""
    start = clock()
    for _ in range(calls):
        drop_grads(grad_to_none)
        fn()
    return (clock() - start) * 1e3


def measure_after_setup(
    setup: Callable[[], object], fn: Callable[[object], object], device: torch.device, *, reps: int = 40
) -> Timing:
    """Time ``fn(setup())`` excluding ``setup``: for stages that consume their input, such as a
    backward pass that can run once per forward. CUDA events bracket ``fn`` only. On a CPU, where
    one rep can take a second, it stops after 5 reps once they took REP_MS of ``fn`` (as `measure`
    does there)."""
    for _ in range(3):
        fn(setup())
    samples = []
    for _ in range(reps):
        if device.type != "cuda" and len(samples) >= 5 and sum(samples) > REP_MS:
            break
        state = setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(state)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn(state)
            samples.append((time.perf_counter() - begin) * 1e3)
    return _summarize(samples)


def _summarize(samples: list[float]) -> Timing:
    deciles = statistics.quantiles(samples, n=10)
    return Timing(statistics.median(samples), deciles[1], deciles[7])


def stage_times(stage: str, timing: Timing) -> dict:
    """A record's fields of one timed stage: ``{stage}_ms`` (median), ``{stage}_p20_ms``, ``{stage}_p80_ms``."""
    return {f"{stage}_ms": timing.median_ms, f"{stage}_p20_ms": timing.p20_ms, f"{stage}_p80_ms": timing.p80_ms}


def shorter_step_note(record: dict) -> str | None:
    """Why a record's fwd+bwd, which runs the forward too, timed below its forward alone; None when it
    did not. The stages are timed one after the other: their p20-p80 ranges overlap (noise, common
    where the backward adds little), or they lie apart and the machine's load changed between them
    (a CPU shared with other processes)."""
    fwd, step = record.get("fwd_ms"), record.get("fwd_bwd_ms")
    if fwd is None or step is None or step >= fwd:
        return None
    if record.get("fwd_bwd_p80_ms", step) >= record.get("fwd_p20_ms", fwd):
        return "fwd+bwd < fwd within timing noise (p20-p80 ranges overlap)"
    return "fwd+bwd < fwd with p20-p80 ranges apart: the load changed between the stages, rerun"


def noted_status(record: dict) -> str:
    """The record's status, with `shorter_step_note` appended where it applies."""
    note = shorter_step_note(record) if record.get("status") == "ok" else None
    return f"{record['status']}; {note}" if note else record["status"]
