"""`fastlm <group> <command>`: benchmarks, cost models, inspection and the main report.

User mistakes (bad flag values, unknown GPU, a GPU-only command without a GPU) end with one
clear sentence and exit status 2, never a traceback.

One module per command group registers its commands (`add_commands`); GROUPS lists them in the
order --help shows them. Building the parser imports neither torch nor Triton: handlers import
what they run inside the function, so `fastlm --help` and `fastlm analyze ...` answer at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from fastlm.cli import analyze, ar, bench, data, inspect, output, profile, report, train
from fastlm.utils.errors import UserError
from fastlm.utils.parser import Parser

GROUPS = (train, data, bench, profile, analyze, ar, inspect, report)


@functools.cache  # parsing leaves the parser unchanged: one per process (main runs in-process in tests)
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fastlm", description=__doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True)
    for group in GROUPS:
        group.add_commands(groups)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; 2 (after one sentence on stderr) for a mistake in how it was called."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command that did not take them, with its --help
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    # torch.profiler's kineto logs every profiler start and stop to stderr at a severity only level 6
    # filters out: the profiling commands' piped output would be mostly that. A value set by the user
    # wins; worker processes inherit it.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    command = " ".join(filter(None, ("fastlm", args.group, getattr(args, "command", None))))
    try:
        status = args.func(args) or 0  # handlers that report their own errors return their status
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not in Python's exit
        return status
    except UserError as error:
        message = str(error)
    except (RuntimeError, MemoryError) as error:  # sizes the machine cannot hold are a user's mistake too
        from fastlm.utils.errors import is_out_of_memory

        if not is_out_of_memory(error):
            raise
        message = f"out of memory ({str(error).splitlines()[0][:160]}); try a smaller --batch, --context or model"
    except KeyboardInterrupt:
        output.error_console.print(f"\n{command}: interrupted", markup=False, highlight=False)
        return 130
    except BrokenPipeError:  # stdout's reader went away (`fastlm ... | head`): stop quietly, status 128 + SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would fail again
        return 141
    output.error_console.print(f"{command}: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return 2
