"""`fastlm train`: the training loop on prepared token data (`fastlm.train`), one process or one per
GPU; its options are the fields of `fastlm.train.config.TrainConfig`. `fastlm train reward` trains a
reward model on ranked responses (`fastlm.train.reward`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from pathlib import Path

from fastlm.cli.arguments import add_command, choice_list
from fastlm.settings import KERNEL_SETS, PRECISION_MEANINGS, PRECISIONS, choices_help
from fastlm.train.config import RewardConfig, TrainConfig, add_arguments
from fastlm.utils.options import add_options, from_namespace


def cmd_train(args) -> int:
    from fastlm.train import loop

    return loop.run(from_namespace(TrainConfig, args), args.prog)


def cmd_train_reward(args) -> int:
    from fastlm.train import reward

    return reward.run(from_namespace(RewardConfig, args))


class _AnyWord(Mapping):
    """The tasks by name as argparse's choices, against which every positional word passes, for
    _Tasks to decide (argparse would call the value of a mistyped option an invalid task)."""

    def __init__(self, tasks: dict[str, argparse.ArgumentParser]) -> None:
        self.tasks = tasks

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        return self.tasks[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, word: object) -> bool:
        return True


class _Tasks(argparse._SubParsersAction):
    """`fastlm train`'s tasks (reward), refusing options of the LM loop typed before the task's name:
    the task's parser would silently replace them with its own defaults. Seen by their values, so an
    option typed with its default value passes unnoticed. A word that names no task (the value of a
    mistyped option: `--held-out 0.1`) joins the unrecognized arguments, which `fastlm` names."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = _AnyWord(self._name_parser_map)

    def __call__(self, parser, namespace, values, option_string=None):
        if values[0] not in self._name_parser_map:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(values)
            return
        given = [
            action.option_strings[-1]
            for action in parser._actions
            if action.option_strings and getattr(namespace, action.dest, action.default) != action.default
        ]
        if given:
            parser.error(
                f"{', '.join(given)} before {values[0]!r} would be ignored: give {values[0]}'s options after it"
            )
        super().__call__(parser, namespace, values, option_string)


# options of `fastlm train` that `fastlm bench train` does not take: each kernel set trains a fresh
# run in one process, without checkpoints (`fastlm.bench.train_kernels`)
NOT_BENCHED = (
    "parallel",
    "bucket_mb",
    "reduce_dtype",
    "shard_optimizer",
    "timeout_s",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "overwrite",
    "override",
)


def add_kernel_comparison_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fastlm train` but those of several processes, checkpoints and resuming, with
    --kernels a comma list of kernel sets to compare."""
    add_arguments(
        p,
        exclude=NOT_BENCHED,
        overrides={
            "kernels": {
                "type": choice_list(KERNEL_SETS, "kernel set"),
                "choices": None,
                "default": KERNEL_SETS,
                "help": "comma list of kernel sets, each trained from the same start",
            },
            "out": {
                "default": Path("runs/bench-train"),  # not `fastlm train`'s: a comparison replaces its runs
                "help": "folder of the comparison: OUT/<kernels>/ per kernel set (log.jsonl, loss.png; replaced by a "
                "later comparison), OUT/kernels.png, records appended to OUT/results/train_kernels.jsonl",
            },
            # one process: the texts of `fastlm train` without its processes and parallel modes
            "micro_batch": {"help": "sequences per forward and backward"},
            "eval_sequences": {
                "help": "held-out windows per evaluation, the first ones of the split; a multiple of --micro-batch, "
                "at least one"
            },
            "batch_tokens": {
                "help": "batch in tokens, a multiple of --context x --micro-batch, reached by gradient accumulation "
                "(default: --context x --micro-batch, no accumulation)"
            },
            "precision": {
                "help": f"{choices_help(PRECISION_MEANINGS, PRECISIONS)} (default: bf16 on a GPU, fp32 without one)"
            },
        },
    )
    p.set_defaults(prog=p.prog)


def add_commands(groups: argparse._SubParsersAction) -> None:
    p = add_command(
        groups,
        "train",
        "train the LM on prepared token data (fastlm data prepare), one process or under torchrun one per GPU",
        cmd_train,
    )
    # --data is checked after parsing (TrainConfig.check): argparse would also demand it of `train reward`
    add_arguments(p, overrides={"data": {"required": False}})
    p.set_defaults(prog=p.prog)
    tasks = p.add_subparsers(dest="command", title="other tasks", metavar="{reward}", action=_Tasks)
    reward = add_command(
        tasks,
        "reward",
        "train a reward model on ranked responses in a JSONL file (fastlm.train.reward)",
        cmd_train_reward,
    )
    add_options(reward, RewardConfig)
    _show_required(p, "data")


def _show_required(parser: argparse.ArgumentParser, dest: str) -> None:
    """The usage line shows option ``dest`` as required (no brackets), as the run demands it, although
    argparse does not check it (it is checked after parsing, see above)."""
    action = next(a for a in parser._actions if a.dest == dest)
    action.required = True
    try:
        usage = parser.format_usage()
    finally:
        action.required = False
    parser.usage = usage.removeprefix("usage: ").strip()
