"""Typed configs whose fields are options (`fastlm.utils.options`): the generated parser, what it
parses back into, and the one-sentence errors of the fields' limits."""

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastlm.utils.errors import UserError
from fastlm.utils.options import SEED_LIMIT, add_options, check_limits, from_namespace, option


@dataclass
class Settings:
    steps: int = option(1000, "optimizer steps", limit="positive")
    lr: float = option(6e-4, "learning rate", limit="positive")
    decay: float = option(0.1, "weight decay", limit="non_negative")
    warmup: int = option(0, "warmup steps", limit="non_negative")
    ratio: float = option(0.5, "a fraction", limit="fraction")
    seed: int = option(0, "the seed", limit="seed")
    out: Path = option(Path("runs"), "a folder", metavar="DIR")
    name: str | None = option(None, "a name (default: the preset's)", choices=("a", "b"))
    fast: bool = option(False, "go fast")
    tags: list[str] = option([], "a tag (repeatable)")


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_options(parser, Settings, **kwargs)
    return parser


def test_the_parser_is_the_fields():
    parser = _parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert list(actions) == [f for f in Settings.__dataclass_fields__]
    assert actions["steps"].option_strings == ["--steps"] and actions["fast"].nargs == 0
    assert actions["lr"].help == "learning rate (default: 0.0006)"  # the default, written once
    assert actions["warmup"].help == "warmup steps (default: 0)" and actions["fast"].help == "go fast"
    assert actions["name"].help == "a name (default: the preset's)"  # a help that says it is kept as it is
    parsed = from_namespace(Settings, parser.parse_args([]))
    assert parsed == Settings() and parsed.tags == [] and parsed.tags is not Settings().tags
    argv = ["--steps", "5", "--lr", "0.1", "--out", "x", "--name", "b", "--fast", "--tags", "p", "--tags", "q"]
    parsed = from_namespace(Settings, parser.parse_args(argv))
    assert parsed == Settings(steps=5, lr=0.1, out=Path("x"), name="b", fast=True, tags=["p", "q"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "c"])  # choices stay argparse's


def test_overrides_and_exclusions():
    parser = _parser(exclude=("seed",), overrides={"name": {"choices": None, "help": "any name", "default": "z"}})
    args = parser.parse_args(["--name", "c"])
    assert not hasattr(args, "seed") and args.name == "c"
    assert parser.parse_args([]).name == "z"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 0, "--steps must be at least 1, got 0"),
        ("lr", float("nan"), "--lr must be a positive number, got nan"),
        ("lr", float("inf"), "--lr must be a positive number, got inf"),
        ("decay", -0.5, "--decay must be 0 or a positive number, got -0.5"),
        ("warmup", -1, "--warmup must be 0 or more, got -1"),
        ("ratio", 1.5, "--ratio must be between 0 and 1, got 1.5"),
        ("seed", SEED_LIMIT, f"--seed must be between 0 and 2**63 - 1, got {SEED_LIMIT}"),
    ],
)
def test_limits_are_one_sentence_naming_the_option(field, value, message):
    check_limits(Settings(steps=1, lr=1.0, decay=0.0, warmup=0, ratio=1.0, seed=SEED_LIMIT - 1))  # edges hold
    with pytest.raises(UserError, match=f"^{message.replace('*', '[*]')}$"):
        check_limits(Settings(**{field: value}))
