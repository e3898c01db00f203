"""`fastlm train`: the training loop on prepared token data (`fastlm.train`), one process or one per GPU."""

from __future__ import annotations

import argparse

from fastlm.cli.arguments import add_command
from fastlm.train_options import add_arguments


def cmd_train(args) -> int:
    from fastlm import train

    return train.run(args)


def add_commands(groups: argparse._SubParsersAction) -> None:
    p = add_command(groups, "train", "train the LM on prepared token data (fastlm data prepare), one process or "
                    "under torchrun one per GPU", cmd_train)  # fmt: skip
    add_arguments(p)
