"""`fastlm data ...`: token data for `fastlm train`."""

from __future__ import annotations

import argparse

from fastlm.cli.arguments import add_command, add_group
from fastlm.data import prepare, verify  # numpy, no torch: the parser stays light


def cmd_data_prepare(args) -> int:
    return prepare.run(args)


def cmd_data_verify(args) -> int:
    return verify.run(args)


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "data", "token data for fastlm train")
    p = add_command(
        commands,
        "prepare",
        "tokenize text files once into memory-mapped token shards with a held-out split",
        cmd_data_prepare,
    )
    prepare.add_arguments(p)
    p = add_command(
        commands, "verify", "read every token shard and compare its sha256 with the manifest's", cmd_data_verify
    )
    verify.add_arguments(p)
