"""`fastlm train ...`: train the model on a task and compare kernel sets or depths."""

from __future__ import annotations

import argparse

from rich.table import Table

from fastlm.cli import output
from fastlm.cli.ar import add_recall_arguments, recall_config
from fastlm.cli.arguments import (
    UserError,
    add_command,
    add_group,
    add_out,
    choice_list,
    int_list,
    positive_float,
    positive_int,
    random_seed,
    text_file,
)
from fastlm.cli.models import KERNEL_SETS, check_heads
from fastlm.devices import current_device
from fastlm.harness.progress import progress_steps
from fastlm.model.config import COMPILE_MODES, PRESETS


def cmd_train_lm(args) -> None:
    from fastlm.harness.records import append_records, with_environment
    from fastlm.tasks.text_training import TextSettings, load_corpus, loss_plot, split_windows, train_kernels

    device = current_device()
    settings = TextSettings(preset=args.preset or ("small" if device.type == "cuda" else "tiny"),
                            context=args.context, batch=args.batch, epochs=args.epochs, lr=args.lr,
                            precision=args.precision or ("bf16" if device.type == "cuda" else "fp32"),
                            seed=args.seed, compile=args.compile)  # fmt: skip
    try:
        windows = split_windows(load_corpus(args.data), settings.context)
    except (OSError, ValueError) as error:
        raise UserError(f"--data: {error}") from None
    steps = settings.epochs * -(-windows[0].shape[0] // settings.batch)
    runs = []
    for kernels in args.kernels:
        with progress_steps(f"{kernels} kernels, step", steps) as step:
            # the loss is not read here: that would synchronize
            runs.append(train_kernels(windows, kernels, settings, device, on_step=lambda done, loss: step()))
    records = [with_environment({"task": "text", "data": str(args.data), "corpus_bytes": args.data.stat().st_size,
                                 **settings.__dict__, **run}) for run in runs]  # fmt: skip
    append_records(args.out / "results" / "text_training.jsonl", records)
    title = (f"{settings.preset} on {args.data.name} ({records[0]['corpus_bytes']:,} bytes), context "
             f"{settings.context}, batch {settings.batch}, {settings.precision}, {settings.compile} · "
             f"{records[0]['gpu']}")  # fmt: skip
    plot = loss_plot(args.out / "reports" / "text_training.png", runs, title)
    table = Table(title=f"Byte-level LM, {settings.epochs} epoch(s) per kernel set")
    for column in ("kernels", "epoch time", "tokens/s", "final train loss", "held-out loss"):
        table.add_column(column)
    for run in runs:
        epoch = sum(run["epoch_seconds"]) / len(run["epoch_seconds"])
        table.add_row(run["kernels"], f"{epoch:.2f} s", f"{run['tokens_per_s']:,.0f}", f"{run['losses'][-1]:.4f}",
                      f"{run['held_out_loss']:.4f}")  # fmt: skip
    output.console.print(table)
    output.console.print(f"[bold]wrote[/] {plot}")


def cmd_train_ar(args) -> None:
    from fastlm.harness.records import append_records, with_environment
    from fastlm.tasks.associative_recall import make_splits
    from fastlm.tasks.recall_training import TARGET_ACCURACY, TrainSettings, accuracy_plot, minimum_layers, train_depth

    task = recall_config(args)
    settings = TrainSettings(d_model=args.d_model, num_heads=args.heads, epochs=args.epochs, batch=args.batch,
                             lr=args.lr, seed=args.seed)  # fmt: skip
    check_heads(settings.d_model, settings.num_heads, rope=True)
    splits = make_splits(task)
    rows = []
    for layers in args.layers:
        with progress_steps(f"{layers} layer(s), epoch", settings.epochs) as step:
            rows += train_depth(task, splits, layers, settings, on_epoch=lambda row: step(
                f"test accuracy {100 * row['test_accuracy']:.1f}%, loss {row['train_loss']:.3f}"))  # fmt: skip
    records = [with_environment({"task": "associative_recall", **task.__dict__, **settings.__dict__, **row})
               for row in rows]  # fmt: skip
    append_records(args.out / "results" / "associative_recall.jsonl", records)
    plot = accuracy_plot(args.out / "reports" / "associative_recall.png", rows,
                         f"Associative recall: {task.num_pairs} pairs, {task.num_keys} keys, {task.num_values} values, "
                         f"{task.num_train} training sequences")  # fmt: skip
    table = Table(title="Test accuracy by depth")
    for column in ("layers", "best", "epoch of best", "first epoch >= 90%", "final"):
        table.add_column(column)
    for layers in args.layers:
        mine = [r for r in rows if r["layers"] == layers]
        best = max(mine, key=lambda r: r["test_accuracy"])
        first = next((r["epoch"] for r in mine if r["test_accuracy"] >= TARGET_ACCURACY), None)
        table.add_row(str(layers), f"{100 * best['test_accuracy']:.1f}%", str(best["epoch"]),
                      "—" if first is None else str(first), f"{100 * mine[-1]['test_accuracy']:.1f}%")  # fmt: skip
    output.console.print(table)
    fewest = minimum_layers(rows)
    answer = "none of these depths" if fewest is None else f"{fewest} layer(s)"
    output.console.print(
        f"Fewest layers reaching {100 * TARGET_ACCURACY:.0f}% test accuracy: {answer}. [bold]wrote[/] {plot}"
    )


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "train", "train the model on a task")
    p = add_command(commands, "lm", "the LM on a byte-level text corpus, torch vs fastlm kernels: time, loss",
                    cmd_train_lm, duration=(
                        "about 4 seconds per kernel set for the 8 kB tests/data/corpus.txt, growing with the text",
                        "a few seconds per epoch of 600 kB of text (small preset), plus compilation under --compile",
                    ))  # fmt: skip
    p.add_argument("--data", type=text_file, required=True, help="any UTF-8 text file (required)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="model preset (default small on a GPU, tiny "
                   "without one)")  # fmt: skip
    p.add_argument("--kernels", type=choice_list(KERNEL_SETS, "kernel set"), default=KERNEL_SETS,
                   help="comma list of kernel sets, each from the same start")  # fmt: skip
    p.add_argument("--context", type=positive_int, default=256, help="bytes per training window")
    p.add_argument("--batch", type=positive_int, default=16, help="windows per step")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over the training windows")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default bf16 on a GPU, fp32 on CPU")
    p.add_argument("--seed", type=random_seed, default=0, help="seed of the weights and of the batch order")
    p.add_argument("--compile", choices=COMPILE_MODES, default="eager",
                   help="eager, compile (torch.compile), or cudagraphs (torch.compile with "
                   "mode='reduce-overhead')")  # fmt: skip
    add_out(p)
    p = add_command(commands, "ar", "associative recall: test accuracy per epoch, sweep over depth", cmd_train_ar,
                    duration=("about 2 minutes for the default depth (2 layers), about 10 minutes for --layers "
                              "1,2,3,4", "the same: it trains on the CPU"))  # fmt: skip
    add_recall_arguments(p)
    p.add_argument("--layers", type=int_list, default=(2,), help="comma list of depths, e.g. 1,2,3,4")
    p.add_argument("--epochs", type=positive_int, default=50, help="passes over the training sequences per depth")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width (a multiple of --heads)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--batch", type=positive_int, default=64, help="sequences per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    add_out(p)
