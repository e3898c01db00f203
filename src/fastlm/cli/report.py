"""`fastlm report`: the main job, every benchmark at its defaults, in one markdown report."""

from __future__ import annotations

import argparse

from fastlm.cli import output
from fastlm.cli.arguments import add_command, add_out
from fastlm.devices import current_device
from fastlm.model.config import ModelConfig
from fastlm.settings import default_precision

CPU_ONLY = (
    "This machine has no GPU, so this is the reduced run: small batch, the tiny model preset, the plain-PyTorch "
    "reference paths instead of the Triton kernels, no torch.compile or Liger baselines. The Triton kernels, the "
    "compile and Liger baselines and the full-size shapes need a CUDA GPU; the numbers below say nothing about "
    "GPU performance."
)


def report_sections(on_gpu: bool) -> tuple:
    """(benchmark, its heading in the report, whether its ## headings become ###), in report order.
    The Hugging Face section needs transformers (the `hf` extra) and is left out without it."""
    import importlib.util

    from fastlm.bench.attention import AttentionBenchmark
    from fastlm.bench.conv1d import Conv1dBenchmark
    from fastlm.bench.host import HostBenchmark
    from fastlm.bench.linear_xent import LinearCrossEntropyBenchmark
    from fastlm.bench.model import ModelBenchmark, rows
    from fastlm.bench.norms import NormsBenchmark
    from fastlm.bench.roofline import RooflineBenchmark
    from fastlm.bench.softmax import SoftmaxBenchmark
    from fastlm.bench.swiglu import SwigluBenchmark
    from fastlm.bench.xent import CrossEntropyBenchmark

    preset = "small" if on_gpu else "tiny"
    compile_modes = ("eager", "compile") if on_gpu else ("eager",)
    precisions = (default_precision(on_gpu),)
    model = ModelBenchmark(
        ((preset, ModelConfig.preset(preset)),),
        tuple(rows(("fwd", "fwd+bwd", "train"), precisions, compile_modes)),
        batch=4,
        warmup=5,
        steps=10,
    )
    sections = [
        (CrossEntropyBenchmark(), "Cross-entropy", False),
        (AttentionBenchmark(("model",)), "Attention", True),
        (model, f"Language model ({preset} preset)", False),
        (NormsBenchmark(), "LayerNorm / RMSNorm", False),
        (SoftmaxBenchmark(), "Masked softmax", False),
        (SwigluBenchmark(), "SwiGLU", False),
        (Conv1dBenchmark(), "Causal conv1d", False),
        (LinearCrossEntropyBenchmark(), "Fused linear + cross-entropy", False),
        (HostBenchmark(modes=compile_modes), "Host cost per call: fastlm vs PyTorch", True),
        (RooflineBenchmark(), "Roofline", False),
    ]
    if importlib.util.find_spec("transformers") is not None:
        from fastlm.bench.hf import HFBenchmark, HFShape
        from fastlm.bench.options import HF_PATCHES

        # Llama-3.2-1B's layers, 4 of its 16 on a GPU to keep the report short
        shape = HFShape.of("llama", "1b", 2048, num_layers=4) if on_gpu else HFShape.of("llama", "tiny", 64)
        hf = HFBenchmark(
            (shape,),
            HF_PATCHES,
            tuple(rows(("train",), precisions, compile_modes)),
            batch=4 if on_gpu else 1,
            warmup=3 if on_gpu else 1,
            steps=10 if on_gpu else 2,
        )
        sections.insert(3, (hf, f"Hugging Face Llama ({shape.size}, {shape.num_layers} layers): apply_fastlm", False))
    return tuple(sections)


def without_cpu_notes(section: str) -> str:
    """A section's markdown without its own "No GPU" paragraphs: the report says that once, first."""
    paragraphs = section.split("\n\n")
    return "\n\n".join(p for p in paragraphs if not p.lstrip("*").startswith("No GPU"))


def cmd_report(args) -> None:
    from fastlm.harness.runner import run_benchmark
    from fastlm.utils.progress import print_line, progress_steps

    device = current_device()
    on_gpu = device.type == "cuda"
    sections = report_sections(on_gpu)
    lines = ["# fastlm report", "", f"Device: {'GPU' if on_gpu else 'CPU only'}."]
    if not on_gpu:
        lines += ["", CPU_ONLY]
        print_line(CPU_ONLY)  # once, for every section: the benchmarks' own notes are not printed
    # one count over every section's steps (the benchmarks without a progress name print their own lines)
    total = sum(benchmark.count(device) for benchmark, _, _ in sections if benchmark.progress_name is not None)
    with progress_steps("report", total) as step:
        for benchmark, heading, demote in sections:
            text = run_benchmark(benchmark, args.out, device, step).read_text()
            if demote:
                text = text.replace("\n## ", "\n### ")
            if not on_gpu:
                text = without_cpu_notes(text)
            lines += ["", text.replace(f"# {benchmark.title}", f"## {heading}", 1)]
    report = args.out / "reports" / "report.md"
    report.write_text("\n".join(lines))
    output.console.print(f"[bold]wrote[/] {report} (tables and plots under {report.parent})")


def add_commands(groups: argparse._SubParsersAction) -> None:
    p = add_command(
        groups,
        "report",
        "the main job: ceilings + every benchmark, written as a markdown report",
        cmd_report,
        duration=("about a minute and a half", "the sum of its benchmarks' times, each given in their --help"),
    )
    add_out(p)
