"""`fastlm data ...`: token data for `fastlm train`."""

from __future__ import annotations

import argparse

from fastlm.cli.arguments import add_command, add_group
from fastlm.data.prepare import add_arguments  # numpy, no torch: the parser stays light


def cmd_data_prepare(args) -> int:
    from fastlm.data import prepare

    return prepare.run(args)


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "data", "token data for fastlm train")
    p = add_command(commands, "prepare", "tokenize text files once into memory-mapped token shards with a held-out "
                    "split", cmd_data_prepare)  # fmt: skip
    add_arguments(p)
