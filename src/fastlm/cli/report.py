"""`fastlm report`: the main job, every benchmark at its defaults, in one markdown report."""

from __future__ import annotations

import argparse

from fastlm.cli import output
from fastlm.cli.arguments import add_command, add_out
from fastlm.cli.bench import (
    run_attention_benchmark,
    run_bandwidth_benchmark,
    run_host_benchmark,
    run_model_benchmark,
    run_roofline,
    run_xent_benchmark,
)
from fastlm.devices import current_device
from fastlm.model.config import ModelConfig


def cmd_report(args) -> None:
    device = current_device()
    xent_report = run_xent_benchmark(args.out, None, None)
    attention_report = run_attention_benchmark(args.out, ("model",))
    from fastlm.bench.model import rows

    preset = "small" if device.type == "cuda" else "tiny"
    model_report = run_model_benchmark(
        args.out,
        [(preset, ModelConfig.preset(preset))],
        rows(("fwd", "fwd+bwd", "train"), ("bf16",), ("eager", "compile") if device.type == "cuda" else ("eager",)),
        batch=4,
        warmup=5,
        steps=10,
        hf=False,
    )
    lines = [
        "# fastlm report",
        "",
        f"Device: {'GPU' if device.type == 'cuda' else 'CPU only'}.",
    ]
    if device.type != "cuda":
        lines += [
            "",
            "This machine has no GPU, so this is the reduced run: small batch, the tiny model preset, the "
            "plain-PyTorch reference "
            "paths instead of the Triton kernels, no torch.compile or Liger baselines. The Triton kernels, the "
            "compile and Liger baselines and the full-size shapes need a CUDA GPU; the numbers below say "
            "nothing about GPU performance.",
        ]
    lines += ["", xent_report.read_text().replace("# Cross-entropy benchmark", "## Cross-entropy")]
    lines += [
        "",
        attention_report.read_text().replace("# Attention benchmark", "## Attention").replace("\n## ", "\n### "),
    ]
    lines += ["", model_report.read_text().replace("# Model benchmark", f"## Language model ({preset} preset)")]
    from fastlm.bench import conv1d, linear_xent, norms, softmax

    for module, name, title in ((norms, "norms", "LayerNorm / RMSNorm"), (softmax, "softmax", "Masked softmax"),
                                (conv1d, "conv1d", "Causal conv1d"),
                                (linear_xent, "linear_xent", "Fused linear + cross-entropy")):  # fmt: skip
        section = run_bandwidth_benchmark(args.out, module, name, title).read_text()
        lines += ["", section.replace(f"# {title}", f"## {title}", 1)]
    host_modes = ("eager", "compile") if device.type == "cuda" else ("eager",)
    host_section = run_host_benchmark(args.out, None, host_modes, None, None).read_text().replace("\n## ", "\n### ")
    lines += ["", host_section.replace("# Host cost per call", "## Host cost per call", 1)]
    lines += ["", run_roofline(args.out).read_text().replace("# Roofline", "## Roofline", 1)]
    report = args.out / "reports" / "report.md"
    report.write_text("\n".join(lines))
    output.console.print(f"[bold]wrote[/] {report} (tables and plots under {report.parent})")


def add_commands(groups: argparse._SubParsersAction) -> None:
    p = add_command(groups, "report", "the main job: ceilings + every benchmark, written as a markdown report",
                    cmd_report, duration=("about 3 minutes", "the sum of its benchmarks' times, each given in their "
                                          "--help"))  # fmt: skip
    add_out(p)
