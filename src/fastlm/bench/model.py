"""`fastlm bench model`: end-to-end step timings of the language model.

Protocol for one row: a random batch of token ids (batch, context); `warmup` untimed steps, then
`steps` timed ones, each bracketed by `timeit.default_timer()` with `torch.cuda.synchronize()`
before the clock stops, so the time is the GPU's, not the launch queue's. The row reports the
first step separately (it pays for compilation, autotuning and allocator growth: with
`--warmup 0` it is one of the timed steps, which shows in the mean and std), mean / std / median
of the timed steps, tokens/s from the median, MFU (`fastlm.analysis.model`) and peak memory.

Modes: `fwd` is the training forward (autograd records the graph, loss included), `fwd+bwd` adds
the backward, `train` adds AdamW's step (fused AdamW on CUDA, for every model). Precision `bf16` is
`torch.autocast(bfloat16)` over the forward with fp32 parameters; `fp32` runs under a null
context. `compile` wraps the model in `torch.compile`; `cudagraphs` in `torch.compile(mode=
"reduce-overhead")`, which replays forward and backward as CUDA graphs, so the steps no longer
pay for launching each kernel from the CPU (what bounds small batches); the optimizer step stays
eager in both. Out-of-memory ends that row with the status "out of memory"; the sweep goes on.

A preset's model is built once and shared by its rows (eager, then each compile mode), so one
compilation per compile mode and precision serves every step mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import timeit
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.analysis.model import MODES, mfu
from fastlm.bench.records import append_records, read_records, with_environment
from fastlm.bench.report import grouped_bar_plot, markdown_table
from fastlm.bench.timing import is_out_of_memory
from fastlm.devices import current_device_name, spec_for_device_name
from fastlm.model import ModelConfig, TransformerLM

RESULTS_FILE = "model.jsonl"
PRECISIONS = ("fp32", "bf16")
COMPILE_MODES = ("eager", "compile", "cudagraphs")
SWEEP_COMPILE_MODES = ("eager", "compile")
TORCH_COMPILE_MODE = {"compile": "default", "cudagraphs": "reduce-overhead"}
IMPLEMENTATIONS = ("fastlm", "hf-llama")  # our TransformerLM | transformers' LlamaForCausalLM, same dims

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, targets) -> scalar loss


@dataclass(frozen=True)
class Row:
    """One measurement: how a model is stepped."""

    mode: str
    precision: str
    compile: str


def rows(modes: Sequence[str], precisions: Sequence[str], compile_modes: Sequence[str]) -> list[Row]:
    """Eager rows first, then each compile mode's (one compilation per mode and precision); train
    last in each group, so the AdamW state it allocates never inflates another row's peak memory."""
    return [Row(m, p, c) for c in COMPILE_MODES if c in compile_modes for p in precisions for m in MODES if m in modes]


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW for every model measured here: the fused single-kernel implementation on CUDA, so the
    optimizer costs the same for every model and as little as PyTorch allows."""
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_cuda)


def make_step(
    loss_fn: LossFn,
    model: torch.nn.Module,
    row: Row,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
) -> Callable[[], None]:
    device = tokens.device

    def forward() -> torch.Tensor:
        with precision_context(row.precision, device):
            return loss_fn(tokens, targets)

    def step() -> None:
        if row.compile == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead
        if row.mode == "fwd":
            forward()
            return
        model.zero_grad(set_to_none=True)
        forward().backward()
        if row.mode == "train":
            optimizer.step()

    return step


def time_steps(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each of the warmup + steps calls, synchronized before the clock stops."""
    times = []
    for _ in range(warmup + steps):
        start = timeit.default_timer()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((timeit.default_timer() - start) * 1e3)
    return times


def summarize(times: list[float], warmup: int, tokens_per_step: int) -> dict:
    timed = times[warmup:]
    median = statistics.median(timed)
    return {
        "first_step_ms": times[0],
        "mean_ms": statistics.mean(timed),
        "std_ms": statistics.stdev(timed) if len(timed) > 1 else 0.0,
        "median_ms": median,
        "tokens_per_s": tokens_per_step / (median / 1e3),
    }


def build_hf_llama(config: ModelConfig) -> torch.nn.Module:
    """Hugging Face `LlamaForCausalLM` with our dimensions (same parameter count: untied head, no
    biases, RMSNorm, SwiGLU, RoPE), SDPA attention."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise ImportError("the hf-llama comparison needs the transformers package (pip install transformers)") from None
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.context_length,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf_config)


def _build(implementation: str, config: ModelConfig, device: torch.device) -> torch.nn.Module:
    if implementation == "fastlm":
        return TransformerLM(config).to(device)
    return build_hf_llama(config).to(device)


def _loss_fn(implementation: str, module: torch.nn.Module) -> LossFn:
    if implementation == "fastlm":
        return module
    return lambda tokens, targets: module(input_ids=tokens, labels=targets).loss


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_config(
    config: ModelConfig,
    preset: str,
    row_list: Sequence[Row],
    *,
    batch: int,
    warmup: int,
    steps: int,
    device: torch.device,
    implementation: str = "fastlm",
    progress: Callable[[str], None] = lambda done: None,
) -> list[dict]:
    """Every row for one model configuration; one record per row."""
    base = {
        "op": "model",
        "implementation": implementation,
        "preset": preset,
        **dataclasses.asdict(config),
        "batch": batch,
        "warmup": warmup,
        "steps": steps,
    }
    spec = spec_for_device_name(current_device_name())
    records = []
    model = None
    compiled: dict[str, torch.nn.Module] = {}
    try:
        model = _build(implementation, config, device)
        tokens = torch.randint(0, config.vocab_size, (batch, config.context_length), device=device)
        targets = torch.randint(0, config.vocab_size, (batch, config.context_length), device=device)
    except RuntimeError as error:
        if not is_out_of_memory(error):
            raise
        model = None
    for row in row_list:
        record = {**base, **dataclasses.asdict(row)}
        if model is None:
            records.append(with_environment({**record, "status": "out of memory"}))
            progress(f"{preset} {row.mode} {row.precision} {row.compile}")
            continue
        if row.compile != "eager" and row.compile not in compiled:
            torch._dynamo.reset()  # a fresh cache per compilation: never fall back to eager on cache limits
            compiled = {row.compile: torch.compile(model, mode=TORCH_COMPILE_MODE[row.compile])}
        module = compiled[row.compile] if row.compile != "eager" else model
        optimizer = make_optimizer(model) if row.mode == "train" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            step = make_step(_loss_fn(implementation, module), model, row, tokens, targets, optimizer)
            times = time_steps(step, warmup, steps, device)
            record.update(status="ok", **summarize(times, warmup, batch * config.context_length))
            if spec is not None:
                record["mfu"] = mfu(config, row.mode, record["tokens_per_s"], spec)
            if device.type == "cuda":
                record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            record["status"] = "out of memory"
        del optimizer
        model.zero_grad(set_to_none=True)
        _free_memory(device)
        records.append(with_environment(record))
        progress(f"{preset} {row.mode} {row.precision} {row.compile}")
    del model, compiled
    _free_memory(device)
    return records


def run(
    configs: Iterable[tuple[str, ModelConfig]],
    row_list: Sequence[Row],
    *,
    batch: int,
    warmup: int,
    steps: int,
    device: torch.device,
    results_dir: Path,
    implementations: Sequence[str] = ("fastlm",),
    progress: Callable[[str], None] = lambda done: None,
) -> list[dict]:
    """Measure every (configuration, implementation, row); records are appended as each
    configuration finishes, so an interrupted sweep keeps what it measured."""
    records = []
    hf_measured = set()  # the kernel switches do not apply to the HF model: one measurement per shape
    for preset, config in configs:
        for implementation in implementations:
            shape = (config.d_model, config.d_ff, config.num_layers, config.num_heads)
            if implementation == "hf-llama" and shape in hf_measured:
                continue
            if implementation == "hf-llama":
                hf_measured.add(shape)
            measured = measure_config(config, preset, row_list, batch=batch, warmup=warmup, steps=steps,
                                      device=device, implementation=implementation, progress=progress)  # fmt: skip
            append_records(results_dir / RESULTS_FILE, measured)
            records += measured
    return records


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

COLUMNS = [
    ("implementation", "model"),
    ("preset", "preset"),
    ("kernels", "attention / norm / loss"),
    ("mode", "mode"),
    ("precision", "precision"),
    ("compile", "compile"),
    ("first_step_ms", "first step ms"),
    ("mean_ms", "mean ms"),
    ("std_ms", "std ms"),
    ("median_ms", "median ms"),
    ("tokens_per_s", "tokens/s"),
    ("mfu_percent", "MFU %"),
    ("peak_memory_gib", "peak GiB"),
    ("status", "status"),
]


def _display(record: dict) -> dict:
    row = dict(record)
    row["kernels"] = f"{record['attention']} / {record['norm']} / {record['loss']}"
    if record.get("implementation") == "hf-llama":
        row["kernels"] = "transformers (sdpa)"
    if record.get("mfu") is not None:
        row["mfu_percent"] = 100 * record["mfu"]
    return row


def _mfu_plot(records: list[dict], reports_dir: Path) -> Path | None:
    """MFU of the training step per preset, one bar per (implementation, kernels, precision, compile)."""
    train = [r for r in records if r["mode"] == "train" and r.get("mfu") is not None]
    if not train:
        return None
    presets = list(dict.fromkeys(r["preset"] for r in records))

    def series_name(r: dict) -> str:
        if r["implementation"] == "hf-llama":
            return f"HF Llama {r['precision']} {r['compile']} batch {r['batch']}"
        kernels = "fastlm kernels" if r["attention"] == "fastlm" else f"{r['attention']} attention"
        return f"{kernels} {r['precision']} {r['compile']} batch {r['batch']}"

    series: dict[str, list[float | None]] = {}
    for r in train:
        values = series.setdefault(series_name(r), [None] * len(presets))
        values[presets.index(r["preset"])] = 100 * r["mfu"]
    return grouped_bar_plot(reports_dir / "model_mfu.png", presets, series, ylabel="MFU % (bf16 dense peak)",
                            title="Training step MFU by preset (batch x context tokens per step)")  # fmt: skip


def _runs(records: list[dict], count: int) -> list[list[dict]]:
    """The last ``count`` runs, oldest first, each as its own list of records."""
    by_run: dict[str, list[dict]] = {}
    for record in records:
        by_run.setdefault(record["run_id"], []).append(record)
    return list(by_run.values())[-count:]


def render(results_dir: Path, reports_dir: Path, runs: int = 1) -> str:
    """One table per run (the last ``runs`` runs: never mixing timings of runs in a table) and a
    plot of the training-step MFU of all of them."""
    selected = _runs(read_records(results_dir / RESULTS_FILE), runs)
    if not selected:
        return "No model records yet: run `fastlm bench model`.\n"
    lines = []
    for records in selected:
        first = records[0]
        lines += [
            f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · {first['date']} · "
            f"batch {first['batch']} x context {first['context_length']}, vocab {first['vocab_size']}, "
            f"{first['warmup']} warm-up + {first['steps']} timed steps per row",
            "",
            markdown_table([_display(r) for r in records], COLUMNS),
            "",
        ]
    plot = _mfu_plot([r for records in selected for r in records], reports_dir)
    if plot is not None:
        lines.append(f"![training-step MFU]({plot.name})")
    return "\n".join(lines)
