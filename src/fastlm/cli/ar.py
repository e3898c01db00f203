"""`fastlm ar ...`: the associative recall task: the hand-built model, and training the model on it."""

from __future__ import annotations

import argparse

from rich.table import Table

from fastlm.cli import output
from fastlm.cli.arguments import (
    add_command,
    add_group,
    add_out,
    int_list,
    positive_float,
    positive_int,
    random_seed,
)
from fastlm.cli.models import check_heads
from fastlm.utils.errors import UserError
from fastlm.utils.progress import progress_steps

# RecallConfig's fields -> the options that set them
RECALL_OPTIONS = {
    "num_keys": "--keys",
    "num_values": "--values",
    "num_pairs": "--pairs",
    "num_train": "--train",
    "num_test": "--test",
}


def add_recall_arguments(p: argparse.ArgumentParser) -> None:
    """The task: vocabularies, pairs per sequence, split sizes, seed; `recall_config` reads them."""
    p.add_argument("--keys", type=positive_int, default=16, help="key vocabulary")
    p.add_argument("--values", type=positive_int, default=16, help="value vocabulary")
    p.add_argument("--pairs", type=positive_int, default=8, help="key-value pairs per sequence")
    p.add_argument("--train", type=positive_int, default=8000, help="training sequences")
    p.add_argument("--test", type=positive_int, default=1000, help="test sequences")
    p.add_argument("--seed", type=random_seed, default=0, help="seed of the sequences and of the model's weights")


def recall_config(args: argparse.Namespace):
    """The task's ``RecallConfig`` from the options of `add_recall_arguments`."""
    from fastlm.tasks.associative_recall import RecallConfig

    try:
        return RecallConfig(
            num_keys=args.keys,
            num_values=args.values,
            num_pairs=args.pairs,
            num_train=args.train,
            num_test=args.test,
            seed=args.seed,
        )
    except ValueError as error:  # the config names its fields; say which options they are
        message = str(error)
        for field, option in RECALL_OPTIONS.items():
            message = message.replace(field, option)
        raise UserError(message) from None


def cmd_ar_handcrafted(args) -> None:
    from fastlm.tasks.associative_recall import accuracy, handcrafted_model, make_splits

    task = recall_config(args)
    train, test = make_splits(task)
    model = handcrafted_model(task)
    test_accuracy, train_accuracy = accuracy(model, test), accuracy(model, train)
    output.console.print(
        f"Hand-built two-layer attention model (no training): test accuracy "
        f"{100 * test_accuracy:.1f}% on {len(test)} sequences, "
        f"train {100 * train_accuracy:.1f}%"
    )


def cmd_ar_train(args) -> None:
    from fastlm.tasks.associative_recall import make_splits
    from fastlm.tasks.recall_training import TARGET_ACCURACY, TrainSettings, accuracy_plot, minimum_layers, train_depth
    from fastlm.utils.records import append_records, with_environment

    task = recall_config(args)
    settings = TrainSettings(
        d_model=args.d_model, num_heads=args.heads, epochs=args.epochs, batch=args.batch, lr=args.lr, seed=args.seed
    )
    check_heads(settings.d_model, settings.num_heads, rope=True)
    splits = make_splits(task)
    rows = []
    for layers in args.layers:
        with progress_steps(f"{layers} layer(s), epoch", settings.epochs, "epochs") as step:
            rows += train_depth(
                task,
                splits,
                layers,
                settings,
                on_epoch=lambda row: step(
                    f"test accuracy {100 * row['test_accuracy']:.1f}%, loss {row['train_loss']:.3f}"
                ),
            )
    records = [
        with_environment({"task": "associative_recall", **task.__dict__, **settings.__dict__, **row}) for row in rows
    ]
    append_records(args.out / "results" / "associative_recall.jsonl", records)
    plot = accuracy_plot(
        args.out / "reports" / "associative_recall.png",
        rows,
        f"Associative recall: {task.num_pairs} pairs, {task.num_keys} keys, {task.num_values} values, "
        f"{task.num_train} training sequences",
    )
    table = Table(title="Test accuracy by depth")
    for column in ("layers", "best", "epoch of best", "first epoch >= 90%", "final"):
        table.add_column(column)
    for layers in args.layers:
        mine = [r for r in rows if r["layers"] == layers]
        best = max(mine, key=lambda r: r["test_accuracy"])
        first = next((r["epoch"] for r in mine if r["test_accuracy"] >= TARGET_ACCURACY), None)
        table.add_row(
            str(layers),
            f"{100 * best['test_accuracy']:.1f}%",
            str(best["epoch"]),
            "—" if first is None else str(first),
            f"{100 * mine[-1]['test_accuracy']:.1f}%",
        )
    output.console.print(table)
    fewest = minimum_layers(rows)
    answer = "none of these depths" if fewest is None else f"{fewest} layer(s)"
    output.console.print(
        f"Fewest layers reaching {100 * TARGET_ACCURACY:.0f}% test accuracy: {answer}. [bold]wrote[/] {plot}"
    )


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "ar", "associative recall: a hand-built model, and training on the task")
    add_recall_arguments(
        add_command(commands, "handcrafted", "score the hand-built two-layer attention model", cmd_ar_handcrafted)
    )
    p = add_command(
        commands,
        "train",
        "train the model on the task: test accuracy per epoch, sweep over depth",
        cmd_ar_train,
        duration=(
            "about 2 minutes for the default depth (2 layers), about 10 minutes for --layers 1,2,3,4",
            "the same: it trains on the CPU",
        ),
    )
    add_recall_arguments(p)
    p.add_argument("--layers", type=int_list, default=(2,), help="comma list of depths, e.g. 1,2,3,4")
    p.add_argument("--epochs", type=positive_int, default=50, help="passes over the training sequences per depth")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width (a multiple of --heads)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--batch", type=positive_int, default=64, help="sequences per step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    add_out(p)
