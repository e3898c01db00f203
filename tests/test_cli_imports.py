"""`fastlm --help`, every group's --help and every `analyze` command answer without importing torch or
Triton (seconds of imports): a fresh interpreter runs them and says after which one either appeared."""

import argparse
import json
import subprocess
import sys

from fastlm.cli import build_parser

RUN = """
import contextlib, io, json, sys

from fastlm.cli import build_parser, main

heavy = lambda: sorted({name.split(".")[0] for name in sys.modules} & {"torch", "triton"})
build_parser()
loaded = {"build_parser()": heavy()}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
    loaded[" ".join(argv)] = heavy()
print(json.dumps(loaded))
"""


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices


def test_help_and_analyze_import_neither_torch_nor_triton():
    groups = _commands(build_parser())
    argvs = [
        ["--help"],
        *([group, "--help"] for group in groups),
        *(["analyze", c] for c in _commands(groups["analyze"])),
    ]
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(argvs)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert len(loaded) == 1 + len(argvs)
    assert not any(loaded.values()), f"torch or triton imported by: {[k for k, v in loaded.items() if v][0]}"
