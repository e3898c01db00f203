"""`fastlm ar ...`: the associative recall task without training, and the task options `train ar` shares."""

from __future__ import annotations

import argparse

from fastlm.cli import output
from fastlm.cli.arguments import UserError, add_command, add_group, positive_int, random_seed

# RecallConfig's fields -> the options that set them
RECALL_OPTIONS = {"num_keys": "--keys", "num_values": "--values", "num_pairs": "--pairs", "num_train": "--train",
                  "num_test": "--test"}  # fmt: skip


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
        return RecallConfig(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                            num_train=args.train, num_test=args.test, seed=args.seed)  # fmt: skip
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
    output.console.print(f"Hand-built two-layer attention model (no training): test accuracy "
                         f"{100 * test_accuracy:.1f}% on {len(test)} sequences, "
                         f"train {100 * train_accuracy:.1f}%")  # fmt: skip


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "ar", "associative recall without training")
    add_recall_arguments(add_command(commands, "handcrafted", "score the hand-built two-layer attention model",
                                     cmd_ar_handcrafted))  # fmt: skip
