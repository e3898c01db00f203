"""`python -m fastlm.data prepare|verify ...`: the same as `fastlm data prepare|verify ...`."""

from fastlm.data import prepare, verify
from fastlm.utils.parser import Parser

COMMANDS = {
    "prepare": (prepare, "tokenize text files into token shards"),
    "verify": (verify, "check every shard's sha256 against the manifest"),
}

parser = Parser(prog="python -m fastlm.data", description=__doc__.splitlines()[0])
commands = parser.add_subparsers(dest="command", required=True)
for name, (module, summary) in COMMANDS.items():
    module.add_arguments(commands.add_parser(name, help=summary, description=module.__doc__.splitlines()[0]))
args = parser.parse_args()
raise SystemExit(COMMANDS[args.command][0].run(args))
