"""Every invalid argument of every `fastlm` command ends with one sentence that names the option,
exit status 2 and no traceback; every option's --help shows its help and default.

The bad values come from each option's argparse type (a table below), so an option added with a
type the table does not know fails the test until it gets bad values of its own.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastlm.cli import arguments, bench, bench_distributed, build_parser, main
from fastlm.cli.train import add_kernel_comparison_arguments
from fastlm.data import prepare, tokenizer
from fastlm.train import config as train_config
from fastlm.train import loop
from fastlm.utils import host_memory

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
MISSING = "/nonexistent/fastlm/corpus.txt"
# where no output folder can be: a file, a folder under a file, a file system that takes no folders
NOT_A_FOLDER = (str(CORPUS), str(CORPUS / "sub"), "/proc/fastlm-out")

BAD_VALUES = {  # argparse type -> values it must refuse
    arguments.positive_int: ("0", "-3", "two", "2.5", ""),
    arguments.non_negative_int: ("-1", "two", "0.5"),
    arguments.random_seed: ("-1", "two", str(2**63)),
    arguments.positive_float: ("0", "-1", "nan", "inf", "two"),
    arguments.int_list: ("", "0", "1,,2", "2,two"),
    arguments.float_list: ("", "0", "nan", "1,inf", "1,two"),
    bench._host_ops: ("", "bogus", "xent,bogus"),
    bench._sweep_list: ("", "bogus"),
    bench_distributed._variant_list: ("", "bogus", "bucketed-0", "bucketed-nan", "ddp,"),
    bench_distributed._optimizer_list: ("", "bogus", "adamw,bogus"),
    bench._rounds: ("0", "2", "two"),  # at least HOST_MIN_ROUNDS (3): a median and a spread
    arguments.folder: NOT_A_FOLDER,
    arguments.text_file: (MISSING, str(CORPUS.parent), "{empty}"),
}
# Options generated from a typed config (`fastlm.utils.options`: training's, and the model options of
# the benchmarks and profilers) and those of data prepare take plain int / float / Path values and
# check them after parsing (`python -m fastlm.train` and `python -m fastlm.data` share the checks).
BAD_VALUES |= {
    int: ("-1", "two"),
    float: ("-1", "nan", "two"),
    Path: (MISSING,),
    train_config.checkpoint_step: ("0", "-1", "two"),
    tokenizer.tokenizer_spec: ("bogus", "bpe:", "bpe:257", "bpe:two", MISSING),
    prepare.separator_text: ("",),
}
CHECKED_AFTER_PARSING = {
    ("train",),
    ("train", "reward"),
    ("data", "prepare"),
    ("bench", "train"),
    ("bench", "model"),
    ("profile", "model"),
    ("profile", "memory"),
    ("analyze", "memory"),
}
CHOICE_LIST = ("", "bogus", "a,,b")  # any comma-separated subset of choices (`choice_list`)
VALID = {"--data": str(CORPUS), "--input": str(CORPUS), "--out": "{empty_dir}"}  # the required options


def _subcommands(parser=None, prefix=()):
    """(argv prefix, parser) of every command that runs something."""
    parser = parser or build_parser()
    if parser.get_default("func") is not None:  # `fastlm train` runs something and has a subcommand
        yield prefix, parser
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, child in (sub[0].choices if sub else {}).items():
        yield from _subcommands(child, (*prefix, name))


def _options(parser):
    """Options that take a value (flags and --help take none)."""
    return [a for a in parser._actions if a.option_strings and a.nargs != 0]


def _bad_values(action) -> tuple[str, ...]:
    if action.type is Path and action.option_strings[0] == "--out":
        return NOT_A_FOLDER
    if action.choices is not None:
        return ("bogus",)
    if action.type in BAD_VALUES:
        return BAD_VALUES[action.type]
    if getattr(action.type, "__qualname__", "") == "comma_list.<locals>.parse":  # a `choice_list(...)`
        return CHOICE_LIST
    raise AssertionError(f"no bad values for {action.option_strings[0]} of type {action.type!r}: add them")


def _base_argv(command, parser):
    argv = list(command)
    for action in parser._actions:
        if (action.required or "(required)" in (action.help or "")) and action.option_strings:
            argv += [action.option_strings[0], VALID[action.option_strings[0]]]
    return argv


CASES = [
    pytest.param(
        [*_base_argv(command, parser), action.option_strings[0], value],
        action.option_strings[0],
        id=f"{' '.join(command)} {action.option_strings[0]}={value!r}",
    )
    for command, parser in _subcommands()
    for action in _options(parser)
    for value in _bad_values(action)
]


def _run(argv, capsys) -> tuple[int, str]:
    """Exit status and everything printed, from the entry point run in this process."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize(("argv", "option"), CASES)
def test_bad_value_is_refused_naming_the_option(argv, option, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.touch()
    argv = [arg.replace("{empty}", str(empty)).replace("{empty_dir}", str(tmp_path / "out")) for arg in argv]
    status, output = _run(argv, capsys)
    assert status == 2
    last = output.strip().splitlines()[-1]
    named = f"error: argument {option}" in last
    if tuple(a for a in argv[:2] if not a.startswith("-")) in CHECKED_AFTER_PARSING:
        named = named or f"error: {option} " in last
    assert last.startswith(f"fastlm {argv[0]}") and named, output
    assert "Traceback" not in output


NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs for NCCL")
# Values each valid on its own that the command refuses together, or that the machine refuses:
# refused after parsing, before any work, with the options named.
SEMANTIC_CASES = [
    (["ar", "train", "--d-model", "10", "--heads", "3"], "--d-model (10) must be divisible by --heads (3)"),
    (["ar", "train", "--d-model", "6", "--heads", "2"], "--d-model / --heads (6 / 2 = 3) must be even"),
    (["bench", "model", "--heads", "3"], "--d-model (64) must be divisible by --heads (3)"),  # tiny's width
    (["bench", "model", "--d-model", "30", "--d-ff", "64", "--layers", "1", "--heads", "4"], "--d-model (30)"),
    (["profile", "memory", "--preset", "tiny,small"], "--preset and --kernels name 2 models"),
    (["profile", "model", "--kernels", "torch,fastlm"], "--preset and --kernels name 2 models"),
    (["analyze", "attention", "--d-model", "30", "--heads", "7"], "--d-model (30) must be divisible by --heads"),
    (["analyze", "mha", "--d-model", "30", "--heads", "7"], "--d-model (30) must be divisible by --heads"),
    (["ar", "handcrafted", "--keys", "1", "--values", "1", "--pairs", "2"], "--keys=1, --values=1, --pairs=2"),
    pytest.param(
        ["bench", "allreduce", "--backend", "nccl"], "--backend nccl needs one GPU per process", marks=NEEDS_NO_GPU
    ),
    pytest.param(["bench", "ddp", "--backend", "nccl"], "--backend nccl needs one GPU per process", marks=NEEDS_NO_GPU),
    pytest.param(["bench", "model", "--compile", "cudagraphs"], "--compile cudagraphs needs a GPU", marks=NEEDS_NO_GPU),
    (["data", "prepare", "--input", "{binary}", "--out", "{out}"], "binary.bin"),
    (["data", "verify", "{out}"], "holds no prepared data"),
]


@pytest.mark.parametrize(("argv", "message"), SEMANTIC_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_combination_is_one_sentence(argv, message, capsys, tmp_path):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    argv = [arg.replace("{binary}", str(binary)).replace("{out}", str(tmp_path / "out")) for arg in argv]
    status, output = _run(argv, capsys)
    assert status == 2
    assert output.strip().splitlines()[-1].startswith(f"fastlm {argv[0]} {argv[1]}: error: "), output
    assert message in output and "Traceback" not in output


@NEEDS_NO_GPU
def test_bench_hf_on_a_cpu_refuses_a_model_the_host_cannot_hold(capsys, monkeypatch):
    monkeypatch.setattr(host_memory, "host_memory", lambda: 16 * 10**9)
    status, output = _run(["bench", "hf", "--size", "1b", "--patches", "none,fastlm"], capsys)
    assert status == 2
    assert "the training state of 2 model(s) of llama 1b (1.24B parameters each: fp32 weights" in output
    assert "needs about 39.5 GB, more than half of the 16.0 GB here" in output


def test_train_without_data_is_one_sentence(capsys):
    """`fastlm train` checks --data after parsing, so that `fastlm train reward` need not give it."""
    assert _run(["train"], capsys) == (2, "fastlm train: error: --data is required\n")


def test_a_parsing_mistake_is_one_line_and_options_are_spelled_out(capsys):
    """No usage text (torchrun would print it once per process), and no option taken for a longer
    one it abbreviates (`--gpu h100` is not `--gpus h100`)."""
    assert _run(["analyze", "memory", "--gpu", "h100"], capsys) == (
        2,
        "fastlm analyze memory: error: unrecognized arguments: --gpu h100 (see fastlm analyze memory --help)\n",
    )
    with pytest.raises(SystemExit) as exit_:
        loop.parse_args(["--data", "d", "--preset", "tinny"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m fastlm.train: error: argument --preset: invalid choice: 'tinny'")
    assert error.endswith("(see python -m fastlm.train --help)\n") and len(error.splitlines()) == 1


def test_under_torchrun_a_parsing_mistake_is_its_root_cause(tmp_path, monkeypatch, capsys):
    """torchrun names each process's error file; its failure summary shows the message it holds."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit):
        loop.parse_args(["--data", "d", "--preset", "tinny"])
    assert json.loads(error_file.read_text())["message"] == capsys.readouterr().err.strip()


def test_console_script_refuses_data_that_is_not_prepared_without_a_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "fastlm", "train", "--data", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"fastlm train: error: --data {tmp_path}")
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("command", [c for c, _ in _subcommands()], ids=" ".join)
def test_every_option_shows_help_and_default(command):
    parser = dict(_subcommands())[command]
    formatter = parser._get_formatter()
    for action in _options(parser):
        text = formatter._expand_help(action)
        assert action.help, f"{' '.join(command)} {action.option_strings[0]} has no help text"
        shown = "default" in text or action.required or "(required)" in text  # `fastlm train --data`: checked later
        assert shown, f"{' '.join(command)} {action.option_strings[0]}: {text}"


def test_help_shows_defaults_and_the_expected_duration(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ar", "train", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--epochs EPOCHS passes over the training sequences per depth (default: 50)" in text
    assert "--layers LAYERS comma list of depths, e.g. 1,2,3,4 (default: 2)" in text
    assert "Expected duration with the defaults: on an idle 2-core CPU" in text and "on a GPU" in text


# The commands that take more than a few seconds: each states its wall time with the defaults.
LONG_COMMANDS = {
    "bench xent",
    "bench attention",
    "bench norms",
    "bench softmax",
    "bench conv1d",
    "bench host",
    "bench model",
    "bench allreduce",
    "bench ddp",
    "bench swiglu",
    "bench hf",
    "bench moe",
    "bench train",
    "profile model",
    "profile memory",
    "ar train",
    "inspect compiled-xent",
    "report",
}


@pytest.mark.parametrize(
    ("argv", "unrecognized"),
    [(["--held-out", "0.1"], "--held-out 0.1"), (["--batch", "16"], "--batch 16"), (["rewrd"], "rewrd")],
)
def test_train_names_a_mistyped_option_and_its_value(argv, unrecognized, capsys):
    """The value of an option `fastlm train` does not take is not reported as an invalid task."""
    status, output = _run(["train", "--data", str(CORPUS), *argv], capsys)
    assert (status, output) == (
        2,
        f"fastlm train: error: unrecognized arguments: {unrecognized} (see fastlm train --help)\n",
    )


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch, tmp_path):
    from fastlm.harness import ceilings

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ceilings, "record_ceilings", interrupted)
    status, output = _run(["bench", "ceilings", "--out", str(tmp_path)], capsys)
    assert (status, output) == (130, "\nfastlm bench ceilings: interrupted\n")


def test_a_closed_pipe_ends_the_command_quietly():
    """`fastlm ... | head`: the reader goes away before the command writes; no traceback, status 141."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fastlm", "analyze", "memory", "--preset", "small"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()
    assert process.wait(timeout=120) == 141
    assert process.stderr.read() == b""


def test_the_long_commands_state_their_duration():
    durations = {
        " ".join(command): parser.description.partition(" Expected duration")[2] for command, parser in _subcommands()
    }
    assert {command for command, duration in durations.items() if duration} == LONG_COMMANDS
    for command in LONG_COMMANDS:
        assert re.fullmatch(r" with the defaults: on an idle 2-core CPU .+; on a GPU .+\.", durations[command]), command


@pytest.mark.parametrize("option", ["--parallel", "--resume", "--overwrite", "--override", "--checkpoint-every"])
def test_bench_train_offers_no_option_it_would_ignore_or_refuse(option, capsys):
    """Each kernel set trains a fresh run in one process without checkpoints: its --help lists
    none of these, and giving one is a parsing error."""
    status, output = _run(["bench", "train", "--help"], capsys)
    listed = re.findall(r"^\s+(--[\w-]+)", output, re.MULTILINE)  # the options, one per help entry
    assert status == 0 and "--kernels" in listed and option not in listed
    status, output = _run(["bench", "train", "--data", str(CORPUS), option], capsys)
    assert status == 2 and f"unrecognized arguments: {option}" in output


def test_bench_train_writes_apart_from_the_training_runs(tmp_path):
    """A comparison replaces its runs: by default it must not land in `fastlm train`'s folder."""
    parse = build_parser().parse_args
    assert parse(["bench", "train", "--data", str(tmp_path)]).out != parse(["train", "--data", str(tmp_path)]).out


def test_bench_train_help_speaks_of_one_process():
    """Its options' texts come from `fastlm train`; none may speak of processes or parallel modes."""
    parser = argparse.ArgumentParser()
    add_kernel_comparison_arguments(parser)
    texts = " ".join(action.help or "" for action in parser._actions)
    assert "--micro-batch" in parser.format_help() and not re.search(r"process|fsdp|--parallel|--shard", texts)
