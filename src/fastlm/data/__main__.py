"""`python -m fastlm.data prepare ...`: the same as `fastlm data prepare ...`."""

import argparse

from fastlm.data import prepare

parser = argparse.ArgumentParser(prog="python -m fastlm.data", description=__doc__.splitlines()[0])
commands = parser.add_subparsers(dest="command", required=True)
prepare.add_arguments(commands.add_parser("prepare", help="tokenize text files into token shards",
                                          description=prepare.__doc__.splitlines()[0]))  # fmt: skip
raise SystemExit(prepare.run(parser.parse_args()))
