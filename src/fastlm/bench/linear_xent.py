"""`fastlm bench linear-xent`: the LM loss from the hidden states, fwd+bwd, for every implementation.

Protocol (one run, one device, every implementation side by side):
- inputs: hidden (N, d) ~ N(0, 1) and weight (V, d) ~ N(0, 1 / d), both bf16 with requires_grad
  (logits of std ~1), targets uniform in [0, V); reduction "mean", the upstream gradient 1
  (`loss.backward()`), as a training step has;
- fwd+bwd: `loss_fn(hidden, weight, targets).backward()`, the gradients dropped before each call
  (`measure`: median, p20, p80; warm-up and compilation excluded);
- TFLOP/s: the three matmuls' 6 N V d FLOPs (logits, grad_hidden, grad_weight) over the fwd+bwd
  time, for every implementation alike (recomputing ones do more work than they are credited
  with), and their fraction of the bf16 matmul rate measured in the same run;
- memory (CUDA): the peak allocated during one fwd+bwd minus what was allocated just before (the
  inputs, the caching allocator's other live blocks excluded), so it includes the gradients of
  hidden and weight, which remain allocated after the step; `peak_excluding_grads_gib` subtracts
  their bytes (N d + V d elements of bf16), leaving what the loss itself costs;
- a case whose memory does not fit is recorded with status "OOM", and the next one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import fastlm
from fastlm.bench.bandwidth import CPU_NOTE
from fastlm.harness.benchmark import Benchmark, Implementation, Run
from fastlm.harness.timing import measure, peak_backward_memory
from fastlm.ops.common import device_arch
from fastlm.ops.linear_cross_entropy import linear_cross_entropy_config
from fastlm.utils.plots import bar_series, time_and_memory_plots
from fastlm.utils.tables import device_line, markdown_table

WIDTH = 4096
GPU_CASES = tuple((tokens, WIDTH, vocab) for tokens in (4096, 8192, 32768) for vocab in (32000, 128256, 256000))
CPU_CASES = ((16, 16, 100),)  # reduced run on machines without a GPU: (N, d, V)
DTYPE = torch.bfloat16
# A fwd+bwd at N=32768, V=256000 takes hundreds of ms: a longer budget than `measure`'s default
# gives several timed calls there
GPU_WARMUP_MS, GPU_REP_MS = 200.0, 2000.0

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, weight, targets)


@dataclass(frozen=True)
class Case:
    tokens: int  # N
    width: int  # d
    vocab: int  # V


def _eager(_case=None) -> LossFn:
    return lambda hidden, weight, targets: F.cross_entropy(hidden @ weight.T, targets)


def _compiled(_case: Case) -> LossFn:
    torch._dynamo.reset()  # a fresh compilation per case
    return torch.compile(_eager(), dynamic=False)


def _matmul_fastlm_ce(_case: Case) -> LossFn:
    return lambda hidden, weight, targets: fastlm.cross_entropy(hidden @ weight.T, targets)


def _fastlm(_case: Case) -> LossFn:
    return lambda hidden, weight, targets: fastlm.linear_cross_entropy(hidden, weight, targets)


def _liger(_case: Case) -> LossFn | str:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return "missing: liger-kernel is not installed"
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, targets: loss(weight, hidden, targets)


def _cce(_case: Case) -> LossFn | str:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return "missing: cut-cross-entropy is not installed"
    return lambda hidden, weight, targets: linear_cross_entropy(hidden, weight, targets)


IMPLEMENTATIONS = (
    Implementation("eager", _eager, "bf16 matmul + F.cross_entropy"),
    Implementation("compile", _compiled, "torch.compile of the eager loss", needs_gpu=True),
    Implementation("matmul+fastlm-ce", _matmul_fastlm_ce, "bf16 matmul + fastlm.cross_entropy (fused path)"),
    Implementation("fastlm", _fastlm, "fastlm.linear_cross_entropy (chunked over tokens)"),
    Implementation("liger", _liger, "Liger-Kernel LigerFusedLinearCrossEntropyLoss", needs_gpu=True),
    Implementation("cce", _cce, "Cut Cross-Entropy linear_cross_entropy (defaults)", needs_gpu=True),
)


def matmul_flops(tokens: int, width: int, vocab: int) -> int:
    """The loss's three matmuls, forward and backward: logits (2 N V d), grad_hidden and grad_weight
    (2 N V d each)."""
    return 6 * tokens * vocab * width


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("tokens", "N"),
    ("vocab", "V"),
    ("implementation", "implementation"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("speedup", "speed-up vs eager"),
    ("tflops", "matmul TFLOP/s"),
    ("percent_of_matmul", "% of measured matmul"),
    ("peak_gib", "peak GiB (with grads)"),
    ("peak_excluding_grads_gib", "peak GiB (without grads)"),
    ("memory_vs_eager", "peak without grads / eager's"),
    ("status", "status"),
]


def table_rows(records: list[dict]) -> list[dict]:
    """The records with their ratios to eager's row of the same case (where eager ran)."""
    eager = {(r["tokens"], r["vocab"]): r for r in records if r["implementation"] == "eager" and r["status"] == "ok"}
    rows = []
    for r in records:
        row = dict(r)
        base = eager.get((r["tokens"], r["vocab"]))
        if r["status"] == "ok":
            row["percent_of_matmul"] = 100 * r["fraction_of_matmul"]
            if base is not None:
                row["speedup"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                if r.get("peak_excluding_grads_gib") is not None and base.get("peak_excluding_grads_gib"):
                    row["memory_vs_eager"] = r["peak_excluding_grads_gib"] / base["peak_excluding_grads_gib"]
        rows.append(row)
    return rows


class LinearCrossEntropyBenchmark(Benchmark):
    name = "linear_xent"
    title = "Fused linear + cross-entropy benchmark"
    progress_name = "linear_xent"
    cpu_note = CPU_NOTE
    measures_ceilings = True

    def cases(self, device: torch.device) -> list[Case]:
        return [Case(*case) for case in (GPU_CASES if device.type == "cuda" else CPU_CASES)]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def describe(self, case: Case, implementation: Implementation, run: Run) -> dict:
        record = {
            "op": "linear_xent",
            "tokens": case.tokens,
            "width": case.width,
            "vocab": case.vocab,
            "dtype": str(DTYPE).removeprefix("torch."),
            "reduction": "mean",
            "implementation": implementation.name,
            "description": implementation.description,
            "matmul_tflops_measured": run.ceilings["matmul_tflops"],
        }
        if implementation.name == "fastlm":  # the chunk it picked: (chunk_rows, V) logits at a time
            record["chunk_rows"] = linear_cross_entropy_config(device_arch(run.device), DTYPE, case.vocab).chunk_rows
        return record

    def label(self, case: Case, implementation: Implementation) -> str:
        return f"N={case.tokens} V={case.vocab} {implementation.name}"

    def measure(self, case: Case, loss_fn: LossFn, run: Run) -> dict:
        tokens, width, vocab, device = case.tokens, case.width, case.vocab, run.device
        hidden = torch.randn(tokens, width, device=device, dtype=DTYPE, requires_grad=True)
        weight = (torch.randn(vocab, width, device=device) / width**0.5).to(DTYPE).requires_grad_(True)
        targets = torch.randint(0, vocab, (tokens,), device=device)
        budget = dict(warmup_ms=GPU_WARMUP_MS, rep_ms=GPU_REP_MS) if device.type == "cuda" else {}
        timing = measure(
            lambda: loss_fn(hidden, weight, targets).backward(), device, grad_to_none=[hidden, weight], **budget
        )
        tflops = matmul_flops(tokens, width, vocab) / (timing.median_ms * 1e-3) / 1e12
        result = {
            "status": "ok",
            "fwd_bwd_ms": timing.median_ms,
            "fwd_bwd_p20_ms": timing.p20_ms,
            "fwd_bwd_p80_ms": timing.p80_ms,
            "tflops": tflops,
            "fraction_of_matmul": tflops / run.ceilings["matmul_tflops"],
        }
        if device.type == "cuda":
            result.update(peak_backward_memory(lambda: loss_fn(hidden, weight, targets), [hidden, weight]))
        return result

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown section (device line, table, plot links) for the latest run; writes the PNG plots."""
        records = self.latest_records(results_dir)
        if not records:
            return "No fused linear + cross-entropy records yet: run `fastlm bench linear-xent`.\n"
        first = records[0]
        groups = list(dict.fromkeys(f"N={r['tokens']} V={r['vocab']}" for r in records))
        names = [impl.name for impl in IMPLEMENTATIONS]

        def series(key):
            return bar_series(records, groups, lambda r: f"N={r['tokens']} V={r['vocab']}", names, key)

        title = f"Fused linear + cross-entropy, d={first['width']}, bf16 ({first['gpu']})"
        parts = [
            f"{device_line(first)} · d={first['width']}, bf16 hidden and weight, reduction='mean' · measured "
            f"matmul rate {first['matmul_tflops_measured']:.3g} TFLOP/s · TFLOP/s count 6 N V d · peak memory: "
            "allocated during one fwd+bwd above what was allocated before it, with and without the gradients of "
            "hidden and weight",
            markdown_table(table_rows(records), TABLE_COLUMNS),
            *time_and_memory_plots(reports_dir, "linear_xent", groups, series, title),
        ]
        return "\n\n".join(parts)
