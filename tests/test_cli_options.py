"""One vocabulary for --precision and --compile: every command declares them through
`fastlm.cli.arguments` (or a config field), so their choices and wording agree everywhere."""

import argparse
from pathlib import Path

import pytest

import fastlm
from fastlm.cli import build_parser
from fastlm.settings import COMPILE_MEANINGS, COMPILE_MODES, PRECISION_MEANINGS, PRECISIONS

VOCABULARIES = {"--precision": (PRECISIONS, PRECISION_MEANINGS), "--compile": (COMPILE_MODES, COMPILE_MEANINGS)}


def _parsers(parser: argparse.ArgumentParser, path=()):
    """(command words, parser) of every command under ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))
    yield path, parser


def _declared():
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            for flag in set(action.option_strings) & set(VOCABULARIES):
                yield " ".join(path), flag, action


def test_precision_and_compile_are_declared_by_many_commands():
    commands = {(command, flag) for command, flag, _ in _declared()}
    assert len(commands) >= 8  # train, train reward, bench model/hf/host/ddp, profile model/memory


@pytest.mark.parametrize("command,flag,action", list(_declared()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_declaration_takes_the_shared_choices_with_their_meanings(command, flag, action):
    vocabulary, meanings = VOCABULARIES[flag]
    if action.choices is not None:
        choices = tuple(action.choices)
    else:  # a comma list: its type accepts each choice alone and rejects anything else
        choices = tuple(c for c in vocabulary if _accepts(action, c))
        assert not _accepts(action, "fp16") and not _accepts(action, "jit")
    assert choices and set(choices) <= set(vocabulary), command
    for choice in choices:
        assert meanings[choice] in action.help, (command, choice)


def _accepts(action: argparse.Action, text: str) -> bool:
    try:
        action.type(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def test_the_flags_are_spelled_in_one_module():
    cli = Path(fastlm.__file__).parent / "cli"
    spelled = {path.name for path in cli.glob("*.py") for flag in VOCABULARIES if f'"{flag}"' in path.read_text()}
    assert spelled == {"arguments.py"}


def test_train_usage_marks_data_required():
    # --data is checked after parsing (`train reward` does not take it), yet the usage line shows it
    # required, as the run demands it
    train = next(parser for path, parser in _parsers(build_parser()) if path == ("train",))
    usage = train.format_usage()
    assert " --data DIR " in usage and "[--data DIR]" not in usage
    assert train.parse_args(["--steps", "3"]).data is None  # still left for TrainConfig.check
