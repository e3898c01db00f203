"""`fastlm --help`, every group's --help and every `analyze` command answer without importing torch or
Triton (seconds of imports): a fresh interpreter runs them and says after which one either appeared.
Training (`fastlm.train`) imports nothing of the benchmark framework (`fastlm.bench`, `fastlm.harness`)."""

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

import fastlm
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


TRAIN = Path(fastlm.__file__).parent / "train"
MEASURING = ("fastlm.bench", "fastlm.harness")  # the benchmark framework, which training never imports
RUN_TRAINING = """
import sys

from fastlm.train import loop

status = loop.main(sys.argv[1:])
print(sorted(name for name in sys.modules if name.startswith(("fastlm.bench", "fastlm.harness"))))
sys.exit(status)
"""


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement of the file names, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_training_imports_nothing_of_the_benchmark_framework(corpus_data, tmp_path):
    files = sorted(TRAIN.glob("*.py"))
    assert {p.name for p in files} >= {"config.py", "loop.py", "checkpoint.py", "log.py"}
    for path in files:
        measuring = sorted(n for n in _imported_modules(path) if n.startswith(MEASURING))
        assert not measuring, f"{path.name} imports {measuring}"
    # and nothing it imports does, also while it trains (imports inside functions run then)
    argv = [
        "--data",
        str(corpus_data),
        "--out",
        str(tmp_path),
        "--preset",
        "tiny",
        "--context",
        "16",
        "--micro-batch",
        "2",
        "--steps",
        "1",
        "--eval-sequences",
        "2",
    ]
    done = subprocess.run([sys.executable, "-c", RUN_TRAINING, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_import_fastlm_is_light_and_reaches_its_subpackages():
    """`import fastlm` loads no torch; fastlm.layers, fastlm.optim and fastlm.model are attributes
    after it, as the docs use them (`import torch, fastlm` then `fastlm.layers.RMSNorm`)."""
    code = (
        "import sys, fastlm; light = 'torch' not in sys.modules; "
        "print(light, fastlm.layers.RMSNorm.__name__, fastlm.optim.AdamW.__name__, fastlm.model.TransformerLM.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "RMSNorm", "AdamW", "TransformerLM"]
