"""`fastlm bench attention --sweep {naive,compile,flash,model,varlen,window}`: attention timings and memory.

Sweeps (one run, one device, every implementation side by side):
- naive / compile: plain PyTorch attention (materialized scores, causal mask) eager or under
  torch.compile; batch 8, one head ((B, N, D) inputs), fp32, head dims x lengths; 100 forward
  and 100 backward passes after warm-up, synchronized after each (mean ms); memory allocated
  just before backward; out-of-memory is recorded as OOM.
- flash: batch 1, one head ((1, 1, N, D): SDPA's fused backends need 4-D), causal, lengths
  128..65536, head dims 16..128, bf16 and fp32; forward, backward and forward+backward by
  do_bench for fastlm, naive PyTorch (where it fits), SDPA with the flash backend and with the
  cuDNN backend; peak memory of forward+backward.
- model: 32k tokens per batch, 16 heads, head dims 64 and 128, lengths 1k/4k/16k, and two short
  shapes, causal, bf16: fastlm, SDPA flash and cuDNN; TFLOP/s by the conventional FLOP count
  (fastlm.analysis.attention), peak memory, and on a GPU forward+backward also replayed as one
  CUDA graph (no host launch costs).
- varlen: two 32k-token rows of documents of long-tailed lengths, 16 heads, causal in each document,
  bf16: fastlm's packed attention, the same kernels on one causal sequence per row, SDPA flash and
  cuDNN on the documents padded to a batch, FlexAttention with a document mask.
- window: a causal window of 1024 or 256 keys, 4k to 32k tokens, 32k per batch: fastlm's window,
  full causal attention, independent sequences of twice the window (a window's best case), and
  FlexAttention's sliding-window mask.
Their TFLOP/s count each implementation's real work, the query-key pairs its mask shows (4 D FLOPs
each, a causal N x N block as N^2 / 2): padding and what a mask hides do not count.
"""

from __future__ import annotations

import itertools
import math
import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import fastlm
from fastlm.analysis.attention import BACKWARD_FLOPS_RATIO, attention_forward_flops
from fastlm.bench.attention_report import CPU_NOTE, render
from fastlm.bench.options import ATTENTION_SWEEPS
from fastlm.harness.benchmark import Benchmark, Implementation, Run
from fastlm.harness.timing import measure, measure_after_setup, measure_graph_replay, stage_times
from fastlm.utils.records import read_records

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with every intermediate materialized, as textbooks write it."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, device=q.device, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int  # 0: 3-D (B, N, D) inputs without a head dim
    seq: int
    head_dim: int
    dtype: torch.dtype

    def make_inputs(self, device: torch.device) -> list[torch.Tensor]:
        dims = (
            (self.batch, self.seq, self.head_dim)
            if self.heads == 0
            else (self.batch, self.heads, self.seq, self.head_dim)
        )
        return [torch.randn(dims, device=device, dtype=self.dtype, requires_grad=True) for _ in range(3)]

    def record(self) -> dict:
        return {
            "batch": self.batch,
            "heads": max(self.heads, 1),
            "seq": self.seq,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "causal": True,
        }

    @property
    def forward_flops(self) -> float:
        return attention_forward_flops(self.batch, max(self.heads, 1), self.seq, self.seq, self.head_dim, True)


def sweep_shapes(sweep: str, device: torch.device) -> list[Shape]:
    """The configurations of a sweep; machines without a GPU get a short version."""
    gpu = device.type == "cuda"
    if sweep in ("naive", "compile"):
        seqs = (256, 1024, 4096, 8192, 16384) if gpu else (64, 256)
        return [Shape(8, 0, n, d, torch.float32) for d in (16, 32, 64, 128) for n in seqs]
    if sweep == "flash":
        seqs = [2**p for p in range(7, 17)] if gpu else [128, 256]
        return [Shape(1, 1, n, d, t) for t in (torch.bfloat16, torch.float32) for d in (16, 32, 64, 128) for n in seqs]
    if sweep == "model":
        tokens, heads = (32768, 16) if gpu else (512, 2)
        seqs = (1024, 4096, 16384) if gpu else (128, 256)
        shapes = [Shape(tokens // n, heads, n, d, torch.bfloat16) for d in (64, 128) for n in seqs]
        # short sequences, where programs per head are few: a batch of short ones, and a single one
        short = [(16, 32, 512, 64), (1, 32, 1024, 128)] if gpu else [(2, 2, 64, 64)]
        return shapes + [Shape(b, h, n, d, torch.bfloat16) for b, h, n, d in short]
    if sweep == "varlen":
        rows, seq, heads = (2, 32768, 16) if gpu else (1, 256, 2)
        return [Documents(rows, heads, seq, d, torch.bfloat16) for d in (64, 128)]
    if sweep == "window":
        tokens, heads = (32768, 16) if gpu else (512, 2)
        windows, seqs = ((1024, 256), (4096, 16384, 32768)) if gpu else ((32,), (256,))
        return [Window(tokens // n, heads, n, 128, torch.bfloat16, w) for w in windows for n in seqs]
    raise ValueError(f"unknown sweep {sweep!r}; choose from {', '.join(ATTENTION_SWEEPS)}")


@dataclass(frozen=True)
class Window(Shape):
    """A Shape under a causal sliding window of ``window`` keys back."""

    window: int = 0

    def record(self) -> dict:
        return {**super().record(), "window": self.window}

    @property
    def masked_flops(self) -> float:
        """N w - w^2 / 2 query-key pairs per head (N^2 / 2, the causal count, once the window spans
        the sequence), 4 D FLOPs each."""
        n, w = self.seq, self.window
        return 4.0 * self.batch * self.heads * (n * w - w * w / 2 if w < n else n * n / 2) * self.head_dim


@dataclass(frozen=True)
class Documents:
    """``rows`` rows of ``seq`` tokens, each filled with documents (`lengths`)."""

    rows: int
    heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype

    def lengths(self) -> list[int]:
        """Log-normal lengths (median seq / 64, sigma 1: 512 tokens in a 32k row, one in a hundred
        past 5,000), each row's last document cut at its end. Seeded: every implementation gets the
        same documents."""
        generator, lengths = torch.Generator().manual_seed(0), []
        for _ in range(self.rows):
            left = self.seq
            while left:
                draw = float(torch.empty(1).log_normal_(math.log(self.seq / 64), 1.0, generator=generator))
                lengths.append(min(left, max(1, round(draw))))
                left -= lengths[-1]
        return lengths

    def record(self) -> dict:
        lengths = self.lengths()
        dense = Shape(self.rows, self.heads, self.seq, self.head_dim, self.dtype)
        return {**dense.record(), "documents": len(lengths), "longest": max(lengths)}

    @property
    def masked_flops(self) -> float:
        """The real work: causal attention within each document."""
        return sum(attention_forward_flops(1, self.heads, n, n, self.head_dim, True) for n in self.lengths())


@dataclass(frozen=True)
class Case:
    sweep: str
    shape: Shape | Documents


def _naive(_case: Case) -> AttentionFn:
    return naive_attention


def _compiled(_case: Case) -> AttentionFn:
    torch._dynamo.reset()  # one fresh compilation per shape: never fall back to eager on cache limits
    return torch.compile(naive_attention, dynamic=False)


def _fastlm(_case: Case) -> AttentionFn:
    return lambda q, k, v: fastlm.flash_attention(q, k, v, causal=True)


def _sdpa(backend_name: str) -> Callable[[Case], AttentionFn | str]:
    def make(case: Case) -> AttentionFn | str:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.shape.dtype == torch.float32:
            return "unsupported: fp32"
        backend = getattr(SDPBackend, backend_name)

        def attend(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        return attend

    return make


# The varlen and window sweeps' implementations make a setup: (device) -> (leaf inputs in the layout
# the implementation takes, the attention call, its forward FLOPs).


def _dense_setup(shape: Shape, attend: AttentionFn, flops: float | None = None):
    return lambda device: (shape.make_inputs(device), attend, shape.forward_flops if flops is None else flops)


def _varlen_fastlm(case: Case):
    docs = case.shape
    lengths = docs.lengths()

    def setup(device):
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        longest = max(lengths)
        attend = lambda q, k, v: fastlm.flash_attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True
        )
        inputs = [
            torch.randn(sum(lengths), docs.heads, docs.head_dim, device=device, dtype=docs.dtype, requires_grad=True)
            for _ in range(3)
        ]
        return inputs, attend, docs.masked_flops

    return setup


def _varlen_one_sequence(case: Case):
    docs = case.shape
    return _dense_setup(Shape(docs.rows, docs.heads, docs.seq, docs.head_dim, docs.dtype), _fastlm(case))


def _varlen_sdpa_padded(backend_name: str):
    def make(case: Case):
        docs = case.shape
        lengths = docs.lengths()
        padded = Shape(len(lengths), docs.heads, max(lengths), docs.head_dim, docs.dtype)  # a document per entry
        return _dense_setup(padded, _sdpa(backend_name)(case), docs.masked_flops)  # causal: padding is ignored

    return make


def _flex(mask_for):
    """FlexAttention (compiled) under the block mask of ``mask_for(case shape, device)`` ->
    (mask_mod, the Shape of its inputs)."""

    def make(case: Case):
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            return "unavailable: this torch has no torch.nn.attention.flex_attention"
        compiled = torch.compile(flex_attention, dynamic=False)

        def setup(device):
            mask_mod, shape = mask_for(case.shape, device)
            block_mask = create_block_mask(mask_mod, None, None, shape.seq, shape.seq, device=device)
            attend = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
            return shape.make_inputs(device), attend, case.shape.masked_flops

        return setup

    return make


def _document_mask(docs: Documents, device: torch.device):
    """Every row as one sequence: a query sees the keys of its document up to itself."""
    lengths = docs.lengths()
    document = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    mask_mod = lambda b, h, q_idx, kv_idx: (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)
    return mask_mod, Shape(1, docs.heads, sum(lengths), docs.head_dim, docs.dtype)


def _window_mask(shape: Window, device: torch.device):
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx <= shape.window), shape


def _window_fastlm(case: Case):
    shape = case.shape
    attend = lambda q, k, v: fastlm.flash_attention(q, k, v, causal=True, window=(shape.window, -1))
    return _dense_setup(shape, attend, shape.masked_flops)


def _window_chunks(case: Case):
    """Independent causal sequences of twice the window over the same tokens: the cost a window of w
    keys approaches (each query sees about w keys in both)."""
    shape = case.shape
    chunk = min(2 * shape.window, shape.seq)
    return _dense_setup(
        Shape(shape.batch * shape.seq // chunk, shape.heads, chunk, shape.head_dim, shape.dtype), _fastlm(case)
    )


IMPLEMENTATIONS = {
    "naive": Implementation("naive", _naive, "PyTorch eager, materialized scores"),
    "compile": Implementation("compile", _compiled, "torch.compile of the naive attention"),
    "fastlm": Implementation("fastlm", _fastlm, "fastlm.flash_attention (Triton)"),
    "sdpa-flash": Implementation(
        "sdpa-flash", _sdpa("FLASH_ATTENTION"), "SDPA, FlashAttention-2 backend", needs_gpu=True
    ),
    "sdpa-cudnn": Implementation("sdpa-cudnn", _sdpa("CUDNN_ATTENTION"), "SDPA, cuDNN backend", needs_gpu=True),
    "fastlm-varlen": Implementation("fastlm-varlen", _varlen_fastlm, "fastlm.flash_attention_varlen"),
    "fastlm-one-sequence": Implementation(
        "fastlm-one-sequence", _varlen_one_sequence, "fastlm.flash_attention, each row one causal sequence"
    ),
    "sdpa-flash-padded": Implementation(
        "sdpa-flash-padded",
        _varlen_sdpa_padded("FLASH_ATTENTION"),
        "SDPA flash, documents padded to a batch",
        needs_gpu=True,
    ),
    "sdpa-cudnn-padded": Implementation(
        "sdpa-cudnn-padded",
        _varlen_sdpa_padded("CUDNN_ATTENTION"),
        "SDPA cuDNN, documents padded to a batch",
        needs_gpu=True,
    ),
    "flex-documents": Implementation(
        "flex-documents", _flex(_document_mask), "FlexAttention, document mask", needs_gpu=True
    ),
    "fastlm-window": Implementation("fastlm-window", _window_fastlm, "fastlm.flash_attention, causal window"),
    "fastlm-chunks": Implementation("fastlm-chunks", _window_chunks, "fastlm, independent 2w-token sequences"),
    "fastlm-causal": Implementation(
        "fastlm-causal", lambda case: _dense_setup(case.shape, _fastlm(case)), "fastlm, full causal attention"
    ),
    "flex-window": Implementation(
        "flex-window", _flex(_window_mask), "FlexAttention, sliding-window mask", needs_gpu=True
    ),
}
SWEEP_IMPLEMENTATIONS = {
    "naive": ("naive",),
    "compile": ("compile",),
    "flash": ("fastlm", "naive", "sdpa-flash", "sdpa-cudnn"),
    "model": ("fastlm", "sdpa-flash", "sdpa-cudnn"),
    "varlen": ("fastlm-varlen", "fastlm-one-sequence", "sdpa-flash-padded", "sdpa-cudnn-padded", "flex-documents"),
    "window": ("fastlm-window", "fastlm-chunks", "fastlm-causal", "flex-window"),
}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _loop_timings(fn: AttentionFn, q, k, v, device, steps: int, warmup: int) -> dict:
    """The naive/compile protocol: ``steps`` forwards, then ``steps`` backwards (each after an
    untimed forward), timed one by one with a synchronize after each; memory before backward."""
    grad_out = torch.randn_like(q)
    for _ in range(warmup):
        fn(q, k, v).backward(grad_out)
    forward_ms = []
    for _ in range(steps):
        start = timeit.default_timer()
        fn(q, k, v)
        _sync(device)
        forward_ms.append((timeit.default_timer() - start) * 1e3)
    backward_ms = []
    memory_before_backward = None  # CUDA only
    for _ in range(steps):
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v)
        _sync(device)
        if device.type == "cuda":
            memory_before_backward = torch.cuda.memory_allocated()
        start = timeit.default_timer()
        out.backward(grad_out)
        _sync(device)
        backward_ms.append((timeit.default_timer() - start) * 1e3)
    return {
        "fwd_ms": statistics.mean(forward_ms),
        "fwd_std_ms": statistics.stdev(forward_ms),
        "bwd_ms": statistics.mean(backward_ms),
        "bwd_std_ms": statistics.stdev(backward_ms),
        "memory_before_backward_mb": None if memory_before_backward is None else memory_before_backward / 2**20,
    }


def _bench_timings(fn: AttentionFn, q, k, v, device, flops: float) -> dict:
    """do_bench forward, backward (CUDA events around the backward only) and forward+backward;
    peak memory of one forward+backward; TFLOP/s of ``flops`` forward FLOPs (the backward 2.5x)."""
    grad_out = torch.randn_like(q)
    fwd = measure(lambda: fn(q, k, v), device, warmup_ms=25, rep_ms=100)
    bwd = measure_after_setup(lambda: fn(q, k, v), lambda out: out.backward(grad_out), device, reps=10)
    step = measure(lambda: fn(q, k, v).backward(grad_out), device, warmup_ms=25, rep_ms=100, grad_to_none=[q, k, v])
    peak_mb = None  # CUDA only
    if device.type == "cuda":
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn(q, k, v).backward(grad_out)
        torch.cuda.synchronize()
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    return {
        **stage_times("fwd", fwd),
        "bwd_ms": bwd.median_ms,
        **stage_times("fwd_bwd", step),
        "fwd_tflops": flops / fwd.median_ms / 1e9,
        "bwd_tflops": BACKWARD_FLOPS_RATIO * flops / bwd.median_ms / 1e9,
        "fwd_bwd_tflops": (1 + BACKWARD_FLOPS_RATIO) * flops / step.median_ms / 1e9,
        "peak_memory_mb": peak_mb,
    }


def _graph_timings(fn: AttentionFn, q, k, v, flops: float) -> dict:
    """Forward+backward captured as one CUDA graph and replayed: the GPU's time without the host's
    launch costs, which short shapes expose."""
    grad_out = torch.randn_like(q)
    step = measure_graph_replay(lambda: fn(q, k, v).backward(grad_out), q.device, (q, k, v))
    return {
        "fwd_bwd_graph_ms": step.median_ms,
        "fwd_bwd_graph_tflops": (1 + BACKWARD_FLOPS_RATIO) * flops / step.median_ms / 1e9,
    }


@dataclass(frozen=True)
class AttentionBenchmark(Benchmark):
    """The sweeps (among ATTENTION_SWEEPS), in order, each shape with its sweep's implementations."""

    sweeps: tuple[str, ...] = ("model",)

    name = "attention"
    title = "Attention benchmark"
    progress_name = "attention"
    cpu_note = CPU_NOTE

    def cases(self, device: torch.device) -> list[Case]:
        return [Case(sweep, shape) for sweep in self.sweeps for shape in sweep_shapes(sweep, device)]

    def implementations(self, case: Case) -> list[Implementation]:
        return [IMPLEMENTATIONS[name] for name in SWEEP_IMPLEMENTATIONS[case.sweep]]

    def describe(self, case: Case, implementation: Implementation, run: Run) -> dict:
        return {"op": "attention", "sweep": case.sweep, "implementation": implementation.name, **case.shape.record()}

    def label(self, case: Case, implementation: Implementation) -> str:
        shape = case.shape
        return f"{case.sweep} {implementation.name} N={shape.seq} D={shape.head_dim} {shape.record()['dtype']}"

    def measure(self, case: Case, fn: AttentionFn, run: Run) -> dict:
        device = run.device
        if case.sweep in ("varlen", "window"):
            tensors, attend, flops = fn(device)
            return {"status": "ok", **_bench_timings(attend, *tensors, device, flops)}
        tensors = case.shape.make_inputs(device)
        if case.sweep in ("naive", "compile"):
            on_gpu = device.type == "cuda"
            return {
                "status": "ok",
                **_loop_timings(fn, *tensors, device, steps=100 if on_gpu else 3, warmup=3 if on_gpu else 1),
            }
        flops = case.shape.forward_flops
        timings = _bench_timings(fn, *tensors, device, flops)
        if device.type == "cuda" and case.sweep == "model":
            timings |= _graph_timings(fn, *tensors, flops)
        return {"status": "ok", **timings}

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown for the latest run of each of this benchmark's sweeps (not of sweeps that only an
        earlier run measured); writes the PNG plots."""
        records = read_records(results_dir / self.results_file)
        return render([r for r in records if r["sweep"] in self.sweeps], reports_dir)
