"""Loss curves of a Hugging Face model trained by `transformers.Trainer`, unpatched and after
`fastlm.apply_fastlm`, from the same initial weights on the same batches.

The text is this repository's README and docs as UTF-8 bytes (vocabulary 256), cut into windows of
--context + 1 tokens; every run sees the same windows in the same order (Trainer's seeded sampler).
A third run, the unpatched model from its initial weights rounded to bf16 (a change of at most
2^-9 of each weight), measures how far rounding alone moves the curve: the noise floor that the
patched run's difference is compared with. Appends one record per run to
benchmarks/results/hf_loss.jsonl (every logged loss, the mean of the last 10, the largest
difference of a step's loss from the unpatched run's) and draws
benchmarks/reports/hf_loss_<precision>.png (a published size: hf_loss_<family>_<size>_<precision>.png).

    python3 benchmarks/hf_loss_curve.py --steps 200          # a GPU: bf16, about a minute per run
    python3 benchmarks/hf_loss_curve.py --family qwen3_moe --size a3b --steps 50 --batch 4 --context 1024
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import numpy as np
import torch

from fastlm.bench.hf import HFShape, build_model
from fastlm.bench.options import HF_FAMILIES, HF_SIZES
from fastlm.integrations.huggingface import apply_fastlm
from fastlm.utils.plots import line_plot
from fastlm.utils.records import append_records, with_environment

ROOT = Path(__file__).resolve().parents[1]


class ByteWindows(torch.utils.data.Dataset):
    """Windows of ``context`` + 1 bytes of ``text``; labels equal the inputs (the model shifts them)."""

    def __init__(self, text: bytes, context: int) -> None:
        self.tokens = torch.from_numpy(np.frombuffer(text, dtype=np.uint8).astype(np.int64))
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> dict:
        window = self.tokens[i * self.context : (i + 1) * self.context + 1]
        return {"input_ids": window, "labels": window.clone()}


def train(model: torch.nn.Module, data: ByteWindows, args: argparse.Namespace, out: Path) -> list[float]:
    from transformers import Trainer, TrainingArguments

    on_gpu = torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        warmup_steps=args.steps // 10,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        logging_steps=1,
        bf16=on_gpu and args.precision == "bf16",
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        disable_tqdm=True,
        use_cpu=not on_gpu,
    )
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=HF_FAMILIES)
    parser.add_argument(
        "--size", default="tiny", choices=HF_SIZES, help="tiny: 4 layers of 256; else the published dimensions"
    )
    parser.add_argument("--layers", type=int, help="layers of a published size (default: its own)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="bf16 autocast or fp32 (GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "traces" / "hf_loss")
    args = parser.parse_args()
    text = b"\n".join(p.read_bytes() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    data = ByteWindows(text, args.context)
    if args.size == "tiny":
        dims = dict(d_model=256, d_ff=704, num_layers=4, head_dim=64, vocab_size=256)
    else:  # the bytes are token ids below any vocabulary's size
        dims = dict(num_layers=args.layers)
    shape = HFShape.of(args.family, args.size, args.context, **dims)
    torch.manual_seed(0)
    unpatched = build_model(shape)
    patched = apply_fastlm(copy.deepcopy(unpatched))
    rounded = copy.deepcopy(unpatched)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.bfloat16().float())
    records, curves = [], {}
    runs = (("hf", unpatched), ("hf+fastlm", patched), ("hf, start rounded to bf16", rounded))
    for name, model in runs:
        losses = train(model.cuda() if torch.cuda.is_available() else model, data, args, args.out / name)
        curves[name] = losses
        records.append(
            with_environment(
                {
                    "op": "hf_loss",
                    "implementation": name,
                    "family": args.family,
                    "size": args.size,
                    "layers": shape.num_layers,
                    "steps": args.steps,
                    "batch": args.batch,
                    "context": args.context,
                    "lr": args.lr,
                    "precision": args.precision,
                    "losses": losses,
                    "last10_mean": statistics.mean(losses[-10:]),
                    "max_step_difference": max(abs(a - b) for a, b in zip(losses, curves["hf"], strict=True)),
                }
            )
        )
    append_records(ROOT / "benchmarks" / "results" / "hf_loss.jsonl", records)
    base = records[0]["last10_mean"]
    for record in records[1:]:
        print(
            f"last-10 mean loss, {args.precision}: {record['implementation']} {record['last10_mean']:.4f} against hf "
            f"{base:.4f}: {100 * (record['last10_mean'] / base - 1):+.3f}%; largest step difference "
            f"{record['max_step_difference']:.2e}"
        )
    panel = {name: list(enumerate(losses, start=1)) for name, losses in curves.items()}
    name = args.precision if args.size == "tiny" else f"{args.family}_{args.size}_{args.precision}"
    line_plot(
        ROOT / "benchmarks" / "reports" / f"hf_loss_{name}.png",
        [(f"{args.family}, {shape.num_parameters() / 1e6:.1f}M parameters, via Trainer", panel)],
        xlabel="step",
        ylabel="training loss",
        title=f"Unpatched vs patched, {args.precision}",
    )


if __name__ == "__main__":
    main()
