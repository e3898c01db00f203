"""`fastlm bench dpo`: the DPO loss from the policy's last hidden states, fwd+bwd, for every implementation.

Protocol (one run, one device, every implementation side by side):
- inputs: B preference pairs of T tokens per response: hidden (2B, T, d) ~ N(0, 1), chosen rows
  first, and weight (V, d) ~ N(0, 1 / d), both bf16 with requires_grad (logits of std ~1); targets
  (2B, T) uniform in [0, V) with the first eighth of each row (the prompt) set to -100, which every
  implementation leaves out of the sequence log-probabilities (summed, not averaged);
- the loss: DPO's sigmoid loss, beta 0.1, -mean log sigmoid(beta ((c - r) - (c_ref - r_ref))) with
  c, r the policy's sequence log-probabilities of the chosen and rejected responses; the reference
  ones are constants of the loss (0 here), which Liger's module, run without a reference model,
  leaves out: the work is the same;
- fwd+bwd: `loss_fn(hidden, weight, targets).backward()`, the gradients dropped before each call
  (`measure`: median, p20, p80; warm-up and compilation excluded);
- TFLOP/s: the LM head's three matmuls over all 2 B T tokens, 6 (2 B T) V d FLOPs, over the fwd+bwd
  time, for every implementation alike;
- memory (CUDA): `peak_backward_memory`, the peak of one fwd+bwd above the inputs, with and without
  the gradients of hidden and weight;
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
from fastlm.bench.linear_xent import matmul_flops  # the LM head's three matmuls, as the LM loss counts them
from fastlm.harness.benchmark import Benchmark, Implementation, Run
from fastlm.harness.timing import measure, peak_backward_memory
from fastlm.utils.plots import bar_series, time_and_memory_plots
from fastlm.utils.tables import device_line, markdown_table

WIDTH, VOCAB = 4096, 128256
GPU_CASES = tuple((length, pairs, WIDTH, VOCAB) for length in (1024, 4096) for pairs in (2, 4))
CPU_CASES = ((8, 2, 16, 100),)  # reduced run on machines without a GPU: (T, B, d, V)
DTYPE = torch.bfloat16
BETA = 0.1
IGNORE = -100
PROMPT_FRACTION = 8  # the first T / 8 positions of each row are the prompt, left out
# a fwd+bwd at 2 B T = 32768 tokens and V = 128256 takes hundreds of ms: a budget for several timed calls
GPU_WARMUP_MS, GPU_REP_MS = 200.0, 2000.0

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, weight, targets)


@dataclass(frozen=True)
class Case:
    length: int  # T, tokens per response
    pairs: int  # B
    width: int  # d
    vocab: int  # V

    @property
    def tokens(self) -> int:
        """Rows of the LM head: chosen and rejected, 2 B T."""
        return 2 * self.pairs * self.length


def _eager(_case=None) -> LossFn:
    """logits + log_softmax + gather, as TRL's DPOTrainer computes the sequence log-probabilities."""

    def loss(hidden, weight, targets):
        logprobs = F.log_softmax((hidden @ weight.T).float(), dim=-1)  # (2B, T, V)
        picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (2B, T)
        chosen, rejected = torch.where(targets != IGNORE, picked, 0.0).sum(-1).chunk(2)
        return -F.logsigmoid(BETA * (chosen - rejected)).mean()

    return loss


def _compiled(_case: Case) -> LossFn:
    torch._dynamo.reset()  # a fresh compilation per case
    return torch.compile(_eager(), dynamic=False)


def _fastlm(_case: Case) -> LossFn:
    def loss(hidden, weight, targets):
        reference = hidden.new_zeros(hidden.shape[0] // 2, dtype=torch.float32)
        return fastlm.linear_dpo_loss(hidden, weight, targets, targets != IGNORE, reference, reference, beta=BETA).loss

    return loss


def _liger(_case: Case) -> LossFn | str:
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
    except ImportError:
        return "missing: liger-kernel is not installed"
    module = LigerFusedLinearDPOLoss(ignore_index=IGNORE, beta=BETA, compute_nll_loss=False, use_ref_model=False)

    def loss(hidden, weight, targets):
        out = module(weight, hidden, targets)
        return out[0] if isinstance(out, tuple) else out  # versions differ: loss, or (loss, metrics)

    return loss


IMPLEMENTATIONS = (
    Implementation("eager", _eager, "bf16 matmul + log_softmax + gather + DPO loss"),
    Implementation("compile", _compiled, "torch.compile of the eager loss", needs_gpu=True),
    Implementation("fastlm", _fastlm, "fastlm.linear_dpo_loss (one pass over groups of whole pairs)"),
    Implementation("liger", _liger, "Liger-Kernel LigerFusedLinearDPOLoss (no reference model)", needs_gpu=True),
)


# ---------------------------------------------------------------------------------------------
# Tables and plots
# ---------------------------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("length", "T"),
    ("pairs", "B"),
    ("implementation", "implementation"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("speedup", "speed-up vs eager"),
    ("tflops", "matmul TFLOP/s"),
    ("peak_gib", "peak GiB (with grads)"),
    ("peak_excluding_grads_gib", "peak GiB (without grads)"),
    ("memory_vs_eager", "peak without grads / eager's"),
    ("status", "status"),
]


def _group(record: dict) -> str:
    return f"T={record['length']} B={record['pairs']}"


def table_rows(records: list[dict]) -> list[dict]:
    """The records with their ratios to eager's row of the same case (where eager ran)."""
    eager = {_group(r): r for r in records if r["implementation"] == "eager" and r["status"] == "ok"}
    rows = []
    for r in records:
        row, base = dict(r), eager.get(_group(r))
        if r["status"] == "ok" and base is not None:
            row["speedup"] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            if r.get("peak_excluding_grads_gib") is not None and base.get("peak_excluding_grads_gib"):
                row["memory_vs_eager"] = r["peak_excluding_grads_gib"] / base["peak_excluding_grads_gib"]
        rows.append(row)
    return rows


class DPOBenchmark(Benchmark):
    name = "dpo"
    title = "DPO loss from hidden states benchmark"
    progress_name = "dpo"
    cpu_note = CPU_NOTE

    def cases(self, device: torch.device) -> list[Case]:
        return [Case(*case) for case in (GPU_CASES if device.type == "cuda" else CPU_CASES)]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def describe(self, case: Case, implementation: Implementation, run: Run) -> dict:
        return {
            "op": "dpo",
            "length": case.length,
            "pairs": case.pairs,
            "tokens": case.tokens,
            "width": case.width,
            "vocab": case.vocab,
            "dtype": str(DTYPE).removeprefix("torch."),
            "loss_type": "sigmoid",
            "beta": BETA,
            "implementation": implementation.name,
            "description": implementation.description,
        }

    def label(self, case: Case, implementation: Implementation) -> str:
        return f"T={case.length} B={case.pairs} {implementation.name}"

    def measure(self, case: Case, loss_fn: LossFn, run: Run) -> dict:
        device, rows = run.device, 2 * case.pairs
        hidden = torch.randn(rows, case.length, case.width, device=device, dtype=DTYPE, requires_grad=True)
        weight = (torch.randn(case.vocab, case.width, device=device) / case.width**0.5).to(DTYPE).requires_grad_(True)
        targets = torch.randint(0, case.vocab, (rows, case.length), device=device)
        targets[:, : case.length // PROMPT_FRACTION] = IGNORE
        budget = dict(warmup_ms=GPU_WARMUP_MS, rep_ms=GPU_REP_MS) if device.type == "cuda" else {}
        timing = measure(
            lambda: loss_fn(hidden, weight, targets).backward(), device, grad_to_none=[hidden, weight], **budget
        )
        result = {
            "status": "ok",
            "fwd_bwd_ms": timing.median_ms,
            "fwd_bwd_p20_ms": timing.p20_ms,
            "fwd_bwd_p80_ms": timing.p80_ms,
            "tflops": matmul_flops(case.tokens, case.width, case.vocab) / (timing.median_ms * 1e-3) / 1e12,
        }
        if device.type == "cuda":
            result.update(peak_backward_memory(lambda: loss_fn(hidden, weight, targets), [hidden, weight]))
        return result

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown section (device line, table, plot links) for the latest run; writes the PNG plots."""
        records = self.latest_records(results_dir)
        if not records:
            return "No DPO records yet: run `fastlm bench dpo`.\n"
        first = records[0]
        groups = list(dict.fromkeys(_group(r) for r in records))
        names = [impl.name for impl in IMPLEMENTATIONS]

        def series(key):
            return bar_series(records, groups, _group, names, key)

        title = f"DPO loss from hidden states, d={first['width']}, V={first['vocab']}, bf16 ({first['gpu']})"
        parts = [
            f"{device_line(first)} · T tokens per response, B pairs (2 B T rows), d={first['width']}, "
            f"V={first['vocab']}, bf16 hidden and weight, sigmoid loss, beta {first['beta']} · TFLOP/s count "
            "6 (2 B T) V d · peak memory: allocated during one fwd+bwd above what was allocated before it, with "
            "and without the gradients of hidden and weight",
            markdown_table(table_rows(records), TABLE_COLUMNS),
            *time_and_memory_plots(reports_dir, "dpo", groups, series, title),
        ]
        return "\n\n".join(parts)
