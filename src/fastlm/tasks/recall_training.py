"""Training the fastlm model on associative recall, one depth or a sweep of depths.

Each depth trains a fresh `TransformerLM` (multi-head causal attention, RoPE, SwiGLU) on the train
split with AdamW, one pass over shuffled mini-batches per epoch, and scores the test split after
every epoch (accuracy at the query position). The sweep answers "how many layers does recall
need": one layer cannot look up the value *after* a matching key (that needs the previous token
copied next to each value first, which is a second layer's job), two can.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.model import ModelConfig, TransformerLM
from fastlm.tasks.associative_recall import RecallConfig, RecallSplit, accuracy
from fastlm.utils.plots import save_figure

TARGET_ACCURACY = 0.9


@dataclass(frozen=True)
class TrainSettings:
    d_model: int = 64
    num_heads: int = 4
    epochs: int = 50
    batch: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0


def model_config(task: RecallConfig, layers: int, settings: TrainSettings) -> ModelConfig:
    return ModelConfig(
        d_model=settings.d_model,
        d_ff=4 * settings.d_model,
        num_layers=layers,
        num_heads=settings.num_heads,
        vocab_size=task.vocab_size,
        context_length=task.input_length,
    )


def train_depth(
    task: RecallConfig,
    splits: tuple[RecallSplit, RecallSplit],
    layers: int,
    settings: TrainSettings,
    on_epoch: Callable[[dict], None] = lambda row: None,
) -> list[dict]:
    """Train one depth; one row per epoch: layers, epoch, train_loss (mean over the epoch), test_accuracy."""
    train, test = splits
    torch.manual_seed(settings.seed)
    model = TransformerLM(model_config(task, layers, settings))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    generator = torch.Generator().manual_seed(settings.seed)
    rows = []
    for epoch in range(1, settings.epochs + 1):
        model.train()
        order = torch.randperm(len(train), generator=generator)
        losses = []
        for start in range(0, len(train), settings.batch):
            batch = order[start : start + settings.batch]
            loss = model(train.inputs[batch], train.targets[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        row = {
            "layers": layers,
            "epoch": epoch,
            "train_loss": sum(losses) / len(losses),
            "test_accuracy": accuracy(model, test),
        }
        rows.append(row)
        on_epoch(row)
    return rows


def minimum_layers(rows: Sequence[dict], threshold: float = TARGET_ACCURACY) -> int | None:
    """The fewest layers whose test accuracy reached ``threshold`` in any epoch; None if none did."""
    reached = [r["layers"] for r in rows if r["test_accuracy"] >= threshold]
    return min(reached) if reached else None


def accuracy_plot(path: Path, rows: Sequence[dict], title: str) -> Path:
    """Left: test accuracy per epoch, a line per depth. Right: best accuracy per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r["layers"] for r in rows})
    fig, (by_epoch, by_depth) = plt.subplots(1, 2, figsize=(10, 3.8))
    for depth in depths:
        mine = [r for r in rows if r["layers"] == depth]
        by_epoch.plot([r["epoch"] for r in mine], [r["test_accuracy"] for r in mine], label=f"{depth} layer(s)")
    best = [max(r["test_accuracy"] for r in rows if r["layers"] == d) for d in depths]
    by_depth.plot(depths, best, marker="o")
    for ax in (by_epoch, by_depth):
        ax.axhline(TARGET_ACCURACY, color="black", linestyle="--", linewidth=1)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    by_epoch.set_xlabel("epoch")
    by_epoch.legend(fontsize=8)
    by_depth.set_xlabel("layers")
    by_depth.set_xticks(depths)
    by_depth.set_title("best over epochs", fontsize=9)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=120)
