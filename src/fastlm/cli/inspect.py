"""`fastlm inspect ...`: look at the code torch.compile generates and at the dtypes autocast picks."""

from __future__ import annotations

import argparse

from fastlm.cli import output
from fastlm.cli.arguments import add_command, add_group, add_out, positive_int
from fastlm.devices import current_device
from fastlm.utils.progress import print_line


def cmd_inspect_compiled_xent(args) -> None:
    from fastlm.profile.compiled_code import write_compiled_cross_entropy

    device = current_device()
    print_line("compiling F.cross_entropy (forward and backward) with torch.compile")
    path = write_compiled_cross_entropy(args.out / "compiled_cross_entropy.py", device)
    kind = "Triton" if device.type == "cuda" else "C++ (CPU; run on a GPU machine for the Triton kernels)"
    output.console.print(f"[bold]wrote[/] {kind} code generated for cross-entropy to {path}")


def cmd_inspect_autocast(args) -> None:
    from fastlm.profile.autocast import autocast_report

    output.console.print(autocast_report(current_device(), args.terms), markup=False, highlight=False, soft_wrap=True)
    output.console.print("Why these dtypes, and why the sums drift: docs/mixed_precision.md")


def add_commands(groups: argparse._SubParsersAction) -> None:
    commands = add_group(groups, "inspect", "look at generated code")
    p = add_command(
        commands,
        "compiled-xent",
        "write the code torch.compile generates for cross-entropy",
        cmd_inspect_compiled_xent,
        duration=("about 10 seconds", "under 10 minutes"),
    )
    add_out(p, "folder for compiled_cross_entropy.py")
    p = add_command(
        commands,
        "autocast",
        "dtypes of a small model under fp16/bf16 autocast; fp16 vs fp32 sums",
        cmd_inspect_autocast,
    )
    p.add_argument("--terms", type=positive_int, default=1000, help="terms of 0.01 in the accumulation demo")
