"""The same documents as a dense, a packed and a padded batch: a Hugging Face model's training step
for each layout, unpatched and patched.

Documents of long-tailed lengths (log-normal, median ``--median`` tokens, 8 to ``--seq`` tokens)
fill ``--batch`` x ``--seq`` tokens exactly. Layouts of one optimizer step (fused AdamW, bf16
autocast over fp32 weights, eager):
- dense: (batch, seq) random tokens, no mask: the reference step of that many tokens;
- packed: the documents end to end in one row, position ids restarting at each document, each
  document's first token no target (DataCollatorWithFlattening's format);
- padded: micro-batches of ``--padded-batch`` documents, each right-padded to its longest, with an
  attention mask, gradients accumulated over the micro-batches (the same documents and one step);
- packed-micro: the padded layout's micro-batches, each packed into one row instead: what the
  padded layout costs beyond its micro-batching.
Rounds are interleaved over (patch, layout); each step's time is synchronized; per layout the
median step and ms per 1000 real tokens. Appends records to benchmarks/results/hf_layouts.jsonl.

    python3 benchmarks/hf_layouts.py --family llama --size 1b
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fastlm.bench.hf import IMPLEMENTATIONS, HFShape, missing_patch
from fastlm.bench.options import HF_FAMILIES, HF_SIZES
from fastlm.harness.steps import make_optimizer
from fastlm.utils.records import append_records, with_environment

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("dense", "packed", "padded", "packed-micro")


def document_lengths(total: int, median: int, longest: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (sigma 1) in [8, longest] summing to ``total`` (the last one cut)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = torch.empty(1).log_normal_(mean=float(torch.tensor(median).log()), std=1.0, generator=generator)
        lengths.append(int(draw.clamp(8, longest)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def _packed_row(documents: list[torch.Tensor]) -> dict:
    """``documents`` end to end in one row: position ids restarting at each, each first token no target."""
    tokens = torch.cat(documents)
    lengths = [len(d) for d in documents]
    labels = tokens.clone()
    labels[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = -100
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {
        "input_ids": tokens[None].cuda(),
        "position_ids": positions[None].cuda(),
        "labels": labels[None].cuda(),
        "use_cache": False,
    }


def _padded_rows(documents: list[torch.Tensor]) -> dict:
    """``documents`` one a row, right-padded with 0 to the longest, padding no target."""
    longest = max(len(d) for d in documents)
    ids = torch.zeros(len(documents), longest, dtype=torch.long)
    mask = torch.zeros(len(documents), longest, dtype=torch.long)
    for row, document in enumerate(documents):
        ids[row, : len(document)], mask[row, : len(document)] = document, 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": labels.cuda()}


def batches(layout: str, lengths: list[int], batch: int, seq: int, vocab: int, padded_batch: int) -> list[dict]:
    """The model inputs of one optimizer step of ``layout`` (a list of micro-batches), on the GPU."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (sum(lengths),), generator=generator)
    if layout == "dense":
        ids = tokens.view(batch, seq).cuda()
        return [{"input_ids": ids, "labels": ids}]
    documents = list(tokens.split(lengths))
    if layout == "packed":
        return [_packed_row(documents)]
    groups = [documents[first : first + padded_batch] for first in range(0, len(documents), padded_batch)]
    return [(_padded_rows if layout == "padded" else _packed_row)(group) for group in groups]


def step_fn(model, optimizer, micro_batches: list[dict]):
    def step() -> None:
        model.zero_grad(set_to_none=True)
        for inputs in micro_batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**inputs).loss
            (loss / len(micro_batches)).backward()
        optimizer.step()

    return step


def time_step(step, warmup: int, steps: int) -> tuple[list[float], float]:
    """(ms of each timed step, peak GiB)."""
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=HF_FAMILIES, default="llama")
    parser.add_argument("--size", choices=HF_SIZES, default="1b")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--patches", default="none,fastlm", help="comma-separated: none, fastlm, liger")
    parser.add_argument("--batch", type=int, default=4, help="rows of the dense layout")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per dense row; the longest document")
    parser.add_argument("--median", type=int, default=300, help="median document length in tokens")
    parser.add_argument("--padded-batch", type=int, default=8, help="documents per padded micro-batch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shape = HFShape.of(args.family, args.size, args.seq, num_layers=args.layers)
    lengths = document_lengths(args.batch * args.seq, args.median, args.seq)
    inputs = {
        layout: batches(layout, lengths, args.batch, args.seq, shape.vocab_size, args.padded_batch)
        for layout in LAYOUTS
    }
    padded_tokens = sum(b["input_ids"].numel() for b in inputs["padded"])
    print(
        f"{args.family} {args.size} ({shape.num_layers} layers): {len(lengths)} documents, {sum(lengths)} tokens "
        f"(median {int(statistics.median(lengths))}, longest {max(lengths)}); padded: "
        f"{len(inputs['padded'])} micro-batches, {padded_tokens} positions"
    )
    patches = [p for p in args.patches.split(",") if missing_patch(p) is None]
    torch.manual_seed(0)
    with torch.device("cuda"):
        models = {p: IMPLEMENTATIONS[p].make(shape).train() for p in patches}
    optimizers = {p: make_optimizer(m, "bf16") for p, m in models.items()}
    times = {(p, layout): [] for p in patches for layout in LAYOUTS}
    peaks = {key: 0.0 for key in times}
    for _ in range(args.rounds):
        for p in patches:
            for layout in LAYOUTS:
                measured, peak = time_step(step_fn(models[p], optimizers[p], inputs[layout]), args.warmup, args.steps)
                times[p, layout].append(statistics.median(measured))
                peaks[p, layout] = max(peaks[p, layout], peak)
    records = []
    print(
        f"{'patch':>10} {'layout':>7} {'step ms':>9} {'(rounds)':>17} {'ms/1k tokens':>13} {'vs dense':>9} {'GiB':>6}"
    )
    for p in patches:
        dense = statistics.median(times[p, "dense"])
        for layout in LAYOUTS:
            rounds = times[p, layout]
            median = statistics.median(rounds)
            per_k = median / (sum(lengths) / 1000)
            print(
                f"{IMPLEMENTATIONS[p].name:>10} {layout:>12} {median:9.1f} ({min(rounds):7.1f}-{max(rounds):7.1f}) "
                f"{per_k:13.2f} {dense / median:8.2f}x {peaks[p, layout]:6.1f}"
            )
            records.append(
                with_environment(
                    {
                        "op": "hf_layout",
                        "implementation": IMPLEMENTATIONS[p].name,
                        "family": args.family,
                        "size": args.size,
                        "layers": shape.num_layers,
                        "layout": layout,
                        "tokens": sum(lengths),
                        "documents": len(lengths),
                        "padded_batch": args.padded_batch,
                        "padded_positions": padded_tokens,
                        "median_ms": round(median, 2),
                        "round_ms": [round(t, 2) for t in rounds],
                        "peak_gib": round(peaks[p, layout], 2),
                    }
                )
            )
    for layout in LAYOUTS:
        if "none" in patches and "fastlm" in patches:
            ratios = [a / b for a, b in zip(times["none", layout], times["fastlm", layout], strict=True)]
            print(f"{layout}: fastlm {statistics.median(ratios):.2f}x unpatched ({min(ratios):.2f}-{max(ratios):.2f})")
    append_records(ROOT / "benchmarks" / "results" / "hf_layouts.jsonl", records)


if __name__ == "__main__":
    main()
