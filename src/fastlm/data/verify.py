"""`fastlm data verify`: read every shard of prepared token data and compare its size and sha256 with
the manifest's (`fastlm.data.manifest`); opening the data for training checks only a sample.

Also `python -m fastlm.data verify`:

    fastlm data verify data/books     # 0: every shard matches; 1: one line per damaged shard
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastlm.data.manifest import DataError, read_manifest, shard_bytes, verify
from fastlm.utils.progress import progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `fastlm data verify`; `run` carries them out."""
    p.add_argument("data", type=Path, metavar="DIR", help="prepared token data (fastlm data prepare --out)")
    p.set_defaults(prog=p.prog)


def run(args: argparse.Namespace) -> int:
    """`fastlm data verify`; 0 when every shard matches, 1 after a line per damaged shard, 2 after a
    one-line error for a folder that holds no prepared data."""
    try:
        manifest = read_manifest(args.data)
        if manifest is None:
            raise DataError(f"{args.data} holds no prepared data (no manifest.json): run fastlm data prepare")
        total = sum(shard_bytes(manifest, shard) for shard in manifest["shards"])
        with progress("verifying", total=total) as bar:
            problems = verify(args.data, manifest, bar.advance)
    except DataError as error:
        print(f"{args.prog}: error: {error}", flush=True, file=sys.stderr)
        return 2
    for problem in problems:
        print(problem, flush=True)
    if problems:
        print(f"{len(problems)} of {len(manifest['shards'])} shard(s) damaged: prepare the data again", flush=True)
        return 1
    print(
        f"{args.data}: {len(manifest['shards'])} shard(s), {manifest['tokens']:,} tokens, every sha256 matches "
        "the manifest",
        flush=True,
    )
    return 0
