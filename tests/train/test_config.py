"""`TrainConfig`: `fastlm train` and `python -m fastlm.train` parse into it, every field is one
option, and a checkpoint records every field a resumed run may change."""

import dataclasses
from pathlib import Path

from fastlm.cli import build_parser
from fastlm.train import loop
from fastlm.train.config import OVERRIDABLE, TrainConfig
from fastlm.utils.options import from_namespace

ARGV = [
    "--data",
    "d",
    "--preset",
    "tiny",
    "--d-model",
    "32",
    "--steps",
    "7",
    "--lr",
    "0.01",
    "--precision",
    "bf16",
    "--shard-optimizer",
    "--override",
    "lr",
    "--override",
    "steps",
    "--resume",
    "3",
    "--out",
    "o",
]
EXPECTED = TrainConfig(
    data=Path("d"),
    preset="tiny",
    d_model=32,
    steps=7,
    lr=0.01,
    precision="bf16",
    shard_optimizer=True,
    override=["lr", "steps"],
    resume=3,
    out=Path("o"),
)


def test_both_commands_parse_into_the_config():
    assert loop.parse_args(ARGV) == EXPECTED
    assert from_namespace(TrainConfig, build_parser().parse_args(["train", *ARGV])) == EXPECTED
    assert loop.parse_args(["--data", "d", "--resume"]).resume == "newest"


def test_every_field_is_one_option_of_fastlm_train():
    (groups,) = [a for a in build_parser()._actions if a.dest == "group"]
    parser = groups.choices["train"]
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags == [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(TrainConfig)]


def test_the_checkpoint_records_every_field_a_resumed_run_may_change():
    record = TrainConfig(data=Path("d"), preset="tiny", precision="fp32", compile="eager").run_record(
        world=2, data_sha256="ab" * 32, tokenizer="bytes", vocab_size=257
    )
    assert set(OVERRIDABLE) <= set(record)
    assert (record["vocab_size"], record["world_size"], record["batch_tokens"]) == (320, 2, 512 * 8 * 2)
