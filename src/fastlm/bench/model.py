"""`fastlm bench model`: end-to-end step timings of the language model.

Protocol for one round of a row: a random batch of token ids (batch, context); `warmup` untimed
steps, then `steps` timed ones, each bracketed by `timeit.default_timer()` with
`torch.cuda.synchronize()` before the clock stops, so the time is the GPU's, not the launch queue's.
Each row runs `rounds` rounds; the record gives each round's median, their median (tokens/s and MFU
(`fastlm.analysis.model`) come from it) and its spread (lowest and highest round median), p20 / p80,
mean and std of every timed step, the first step of round 1 on its own (it pays for compilation,
autotuning and allocator growth: with `--warmup 0` it is one of the timed steps, which shows in the
mean and std) and peak memory. Rounds are interleaved across all rows of all models (round 1 of
every row, then round 2, ...), so drift of the machine favours none of them, unless every model
would not fit in memory at once: then each row's rounds run back to back (`choose_schedule`).

Modes: `fwd` is the training forward (autograd records the graph, loss included), `fwd+bwd` adds
the backward, `train` adds AdamW's step (fused AdamW on CUDA, for every model). Precision `bf16` is
`torch.autocast(bfloat16)` over the forward with fp32 parameters; `bf16-weights` the same autocast
with every matmul weight stored in bf16 for the round and its fp32 master in fastlm's AdamW
(`fastlm.harness.steps.Row`); `fp32` runs under a null context. `compile` wraps the model
in `torch.compile`; `cudagraphs` in `torch.compile(mode="reduce-overhead")`, which replays
forward and backward as CUDA graphs, so the steps no longer pay for launching each kernel from
the CPU (what bounds small batches); the optimizer step stays eager in both. Out-of-memory ends
that row with the status "out of memory"; the sweep goes on.

A model is built once and shared by its rows (eager, then each compile mode) and its rounds, so one
compilation per compile mode and precision serves every step mode and every round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.analysis.model import MODES, mfu
from fastlm.bench.model_report import CPU_NOTE, render
from fastlm.devices import current_device_name, spec_for_device_name
from fastlm.harness.benchmark import Benchmark, Implementation, Measured, Run, failure_status
from fastlm.harness.steps import LossFn, Row, make_optimizer, make_step, time_steps, weights_stored_for
from fastlm.model import ModelConfig, TransformerLM
from fastlm.settings import COMPILE_MODES, TORCH_COMPILE_MODE, autocasts, stores_bf16_weights
from fastlm.utils.errors import is_out_of_memory
from fastlm.utils.host_memory import check_fits_host, host_budget
from fastlm.utils.records import read_records, with_environment

SWEEP_PRECISIONS = ("fp32", "bf16")
SWEEP_COMPILE_MODES = ("eager", "compile")


def rows(modes: Sequence[str], precisions: Sequence[str], compile_modes: Sequence[str]) -> list[Row]:
    """Eager rows first, then each compile mode's (one compilation per mode and precision); train
    last in each group, so the AdamW state it allocates never inflates another row's peak memory."""
    return [Row(m, p, c) for c in COMPILE_MODES if c in compile_modes for p in precisions for m in MODES if m in modes]


def summarize_rounds(round_times: Sequence[Sequence[float]], warmup: int, tokens_per_step: int) -> dict:
    """Step-time summary of one configuration's rounds (each: ``warmup`` + timed steps, in ms).

    The median is taken per round, then over the rounds; the spread is the lowest and highest round
    median, and p20 / p80 of every timed step pooled. tokens/s comes from the median over rounds."""
    round_median_ms = [statistics.median(times[warmup:]) for times in round_times]
    timed = [t for times in round_times for t in times[warmup:]]
    median = statistics.median(round_median_ms)
    deciles = statistics.quantiles(timed, n=10, method="inclusive") if len(timed) > 1 else [timed[0]] * 9
    return {
        "first_step_ms": round_times[0][0],  # compilation, autotuning, allocator growth: round 1 pays them
        "mean_ms": statistics.mean(timed),
        "std_ms": statistics.stdev(timed) if len(timed) > 1 else 0.0,
        "p20_ms": deciles[1],
        "p80_ms": deciles[7],
        "round_median_ms": round_median_ms,
        "median_ms": median,
        "median_min_ms": min(round_median_ms),
        "median_max_ms": max(round_median_ms),
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


# make(config) -> the model; looked up when called, so tests can stand in for either
IMPLEMENTATIONS = (
    Implementation("fastlm", lambda config: TransformerLM(config), "our TransformerLM"),
    Implementation("hf-llama", lambda config: build_hf_llama(config), "transformers' LlamaForCausalLM, same dims"),
)


@dataclass(frozen=True)
class Subject:
    """One model to build: our TransformerLM of a configuration, or HF Llama of its dimensions."""

    preset: str
    config: ModelConfig
    implementation: Implementation = IMPLEMENTATIONS[0]


def subjects(configs: Iterable[tuple[str, ModelConfig]], implementations: Sequence[Implementation]) -> list[Subject]:
    """Every (configuration, implementation); HF Llama once per shape, since the kernel switches do
    not apply to it."""
    result, hf_shapes = [], set()
    for preset, config in configs:
        for implementation in implementations:
            shape = (config.d_model, config.d_ff, config.num_layers, config.num_heads)
            if implementation.name == "hf-llama":
                if shape in hf_shapes:
                    continue
                hf_shapes.add(shape)
            result.append(Subject(preset, config, implementation))
    return result


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class BuiltModel:
    """A subject's model, its batch of tokens and one compiled module per compile mode, built on first
    use and kept until `release`: later rounds reuse the compiled step (and its CUDA graphs). Between
    rounds only the parameters stay: gradients and the optimizer (with its AdamW state) are made
    anew each round and freed after it."""

    def __init__(self, subject: Subject, batch: int, device: torch.device) -> None:
        self.subject, self.batch, self.device = subject, batch, device
        self.model: torch.nn.Module | None = None
        self.compiled: dict[str, torch.nn.Module] = {}

    def _build(self) -> None:
        config = self.subject.config
        with torch.device(self.device):  # initialized in place: no 8 GB host-side init and copy for xl
            model = self.subject.implementation.make(config)
            self.tokens = torch.randint(0, config.vocab_size, (self.batch, config.context_length))
            self.targets = torch.randint(0, config.vocab_size, (self.batch, config.context_length))
        self.model = model
        self.resident_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))

    def _module(self, compile_mode: str) -> torch.nn.Module:
        if compile_mode == "eager":
            return self.model
        if compile_mode not in self.compiled:
            self.compiled[compile_mode] = torch.compile(self.model, mode=TORCH_COMPILE_MODE[compile_mode])
        return self.compiled[compile_mode]

    def _loss_fn(self, module: torch.nn.Module) -> LossFn:
        if self.subject.implementation.name == "fastlm":
            return module
        return lambda tokens, targets: module(input_ids=tokens, labels=targets).loss

    def round(self, row: Row, warmup: int, steps: int) -> tuple[list[float], float | None]:
        """One round of ``row``: the ms of its warmup + steps calls, and its peak memory in bytes
        (CUDA) less what other kept models held when it began. Out of memory propagates."""
        if self.model is None:
            self._build()
        on_cuda = self.device.type == "cuda"
        others_bytes = torch.cuda.memory_allocated() - self.resident_bytes if on_cuda else 0
        optimizer = None
        with weights_stored_for(self.model, row.precision):
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                optimizer = make_optimizer(self.model, row.precision) if row.mode == "train" else None
                step = make_step(
                    self._loss_fn(self._module(row.compile)), self.model, row, self.tokens, self.targets, optimizer
                )
                times = time_steps(step, warmup, steps, self.device)
                peak = torch.cuda.max_memory_allocated() - others_bytes if on_cuda else None
            finally:
                del optimizer
                self.model.zero_grad(set_to_none=True)
                _free_memory(self.device)
        return times, peak

    def release(self) -> None:
        self.model, self.compiled, self.tokens, self.targets = None, {}, None, None
        _free_memory(self.device)


def row_memory_estimate(config: ModelConfig, row: Row, batch: int) -> int:
    """Napkin bytes one row needs on top of its model's fp32 parameters: gradients (4 bytes per
    parameter) unless forward only, AdamW's two moments (8) in training, autocast's bf16 weight
    copies (2); activations at 34 bytes per token, d_model and layer in 16-bit, twice that in fp32
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": sbh·34
    per layer, without the 5·a·s/h attention-score term that SDPA and flash attention never store);
    fp32 logits and their gradient. The measured xl training step (batch 4, bf16) peaks at 36 GB
    against 42 GB estimated here: the estimate errs on the safe side."""
    parameters = config.num_parameters()
    gradients, adamw, casts = row.mode != "fwd", row.mode == "train", row.precision == "bf16"
    masters = adamw and stores_bf16_weights(row.precision)  # its smaller weights and gradients are left out
    weights = 4 * gradients + 8 * adamw + 2 * casts + 4 * masters
    tokens = batch * config.context_length
    activations = 34 * tokens * config.d_model * config.num_layers * (1 if autocasts(row.precision) else 2)
    return weights * parameters + activations + 8 * tokens * config.vocab_size


def model_memory_estimate(config: ModelConfig, row_list: Sequence[Row], batch: int) -> int:
    """Napkin bytes of one model measured alone: its fp32 parameters and its largest row's memory."""
    return 4 * config.num_parameters() + max(row_memory_estimate(config, row, batch) for row in row_list)


def interleaved_memory_estimate(subject_list: Sequence[Subject], row_list: Sequence[Row], batch: int) -> int:
    """Napkin bytes of an interleaved run: every model's fp32 parameters (kept across rounds), the
    largest row's own memory, and, with CUDA graphs, one pool holding a step's gradients and
    activations (CUDA Graph Trees share one pool per device between all graphed models)."""
    kept = sum(4 * s.config.num_parameters() for s in subject_list)
    largest_row = max(row_memory_estimate(s.config, row, batch) for s in subject_list for row in row_list)
    graph_pool = 0
    if any(row.compile == "cudagraphs" for row in row_list):
        graph_pool = max(
            row_memory_estimate(s.config, Row("fwd+bwd", "bf16", "cudagraphs"), batch) - 2 * s.config.num_parameters()
            for s in subject_list
        )
    return kept + largest_row + graph_pool


def choose_schedule(
    subject_list: Sequence[Subject],
    row_list: Sequence[Row],
    batch: int,
    budget_bytes: int | None,
    interleave: bool | None,
) -> tuple[str, str]:
    """("interleaved" | "back to back", why). ``interleave`` None: interleave where the memory
    estimate fits in ``budget_bytes`` (90% of a GPU's memory, half of a CPU host's: `memory_budget`);
    always without a budget."""
    if interleave is not None:
        return ("interleaved", "--interleave") if interleave else ("back to back", "--no-interleave")
    if budget_bytes is None or len(subject_list) < 2:
        return "interleaved", "auto"
    need, have = interleaved_memory_estimate(subject_list, row_list, batch) / 1e9, budget_bytes / 1e9
    if need <= have:
        return "interleaved", f"auto: every model kept needs about {need:.0f} of the {have:.0f} GB a run may use"
    return "back to back", f"auto: every model kept would need about {need:.0f} of the {have:.0f} GB a run may use"


def memory_budget(device: torch.device) -> int:
    """Bytes a run's memory estimate may reach: 90% of a GPU's memory, `host_budget` on a CPU."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return host_budget()


def check_fits_cpu(
    subject_list: Sequence[Subject],
    row_list: Sequence[Row],
    batch: int,
    interleave: bool | None,
    smaller: str = "--preset, --batch or --context",
) -> None:
    """On a CPU, refuse a run whose estimate under its schedule (`choose_schedule`) does not fit the
    host: there it would swap or be killed, where on a GPU a configuration that does not fit is
    recorded as out of memory and the run goes on. The `preflight` of the benchmarks that run
    `measure_rounds`; ``smaller`` names their options that shrink the run."""
    schedule, _ = choose_schedule(subject_list, row_list, batch, host_budget(), interleave)
    if schedule == "interleaved" and len(subject_list) > 1:
        need, what = interleaved_memory_estimate(subject_list, row_list, batch), "every model of the run kept"
        remedy = ", or --no-interleave"
    else:
        need, preset = max((model_memory_estimate(s.config, row_list, batch), s.preset) for s in subject_list)
        what, remedy = f"the {preset} model alone", ""
    check_fits_host(need, f"{what} at batch {batch}", f"use a smaller {smaller}, or --mode fwd{remedy}")


@contextlib.contextmanager
def _compile_caches_for_many_models():
    """Fresh Dynamo caches, large enough for every (model, compile mode) of a run: models stay
    compiled across rounds, so nothing is reset between them; hitting the limit raises rather than
    silently running eager code."""
    torch._dynamo.reset()
    limits = {"recompile_limit": 256, "accumulated_recompile_limit": 4096, "fail_on_recompile_limit_hit": True}
    with torch._dynamo.config.patch({k: v for k, v in limits.items() if hasattr(torch._dynamo.config, k)}):
        try:
            yield
        finally:
            torch._dynamo.reset()


def measure_rounds(
    subject_list: Sequence[Subject],
    row_list: Sequence[Row],
    *,
    batch: int,
    warmup: int,
    steps: int,
    rounds: int,
    device: torch.device,
    interleave: bool | None = None,
    errors_as_status: bool = False,
) -> Iterator[Measured]:
    """Every (subject, row) for ``rounds`` rounds, one step per round of a (subject, row); one record
    per (subject, row), yielded with the step that finishes its model's last round.

    Interleaved: round 1 of every configuration, then round 2, ..., with every model and its
    compiled modules kept, so slow drift of the machine (clocks, temperature, other tenants) is
    spread over all configurations alike. Back to back: the rounds of one configuration follow
    each other and a model is freed once its rows are done. A configuration that runs out of
    memory is not retried in later rounds; its record says "out of memory". With
    ``errors_as_status``, so does one that raises any other RuntimeError (a third-party model that
    fails to compile, say): its record says "error: " and the message's first line."""
    schedule, why = choose_schedule(subject_list, row_list, batch, memory_budget(device), interleave)
    if schedule == "interleaved":
        plan = [(r, s, row) for r in range(rounds) for s in range(len(subject_list)) for row in row_list]
    else:
        plan = [(r, s, row) for s in range(len(subject_list)) for row in row_list for r in range(rounds)]
    last_use = {s: i for i, (_, s, _) in enumerate(plan)}
    built = [BuiltModel(subject, batch, device) for subject in subject_list]
    times: dict[tuple[int, Row], list[list[float]]] = {(s, row): [] for s in range(len(built)) for row in row_list}
    peaks: dict[tuple[int, Row], list[float]] = {key: [] for key in times}
    failed: dict[tuple[int, Row], str] = {}  # (subject, row) -> its record's status
    spec = spec_for_device_name(current_device_name())
    with _compile_caches_for_many_models():
        for i, (r, s, row) in enumerate(plan):
            subject = subject_list[s]
            if (s, row) not in failed:
                try:
                    round_times, peak = built[s].round(row, warmup, steps)
                    times[s, row].append(round_times)
                    if peak is not None:
                        peaks[s, row].append(peak)
                except RuntimeError as error:
                    if is_out_of_memory(error):
                        failed[s, row] = "out of memory"
                    elif errors_as_status:
                        failed[s, row] = failure_status(error)
                    else:
                        raise
                    _free_memory(device)
            label = (
                f"{subject.preset} {subject.implementation.name} {row.mode} {row.precision} {row.compile} "
                f"round {r + 1}/{rounds}"
            )
            if last_use[s] != i:
                yield Measured(label, [])
                continue
            built[s].release()
            if schedule == "back to back":
                torch._dynamo.reset()  # its compiled code and CUDA graphs go with it
            base = {
                "op": "model",
                "implementation": subject.implementation.name,
                "preset": subject.preset,
                **subject.config.record_fields(),
                "batch": batch,
                "warmup": warmup,
                "steps": steps,
                "rounds": rounds,
                "schedule": schedule,
                "schedule_reason": why,
            }
            model_records = []
            for row in row_list:
                record = {**base, **dataclasses.asdict(row)}
                if (s, row) in failed or not times[s, row]:
                    record["status"] = failed.get((s, row), "out of memory")
                else:
                    record.update(
                        status="ok", **summarize_rounds(times[s, row], warmup, batch * subject.config.context_length)
                    )
                    if spec is not None:
                        record["mfu"] = mfu(subject.config, row.mode, record["tokens_per_s"], spec)
                    if peaks[s, row]:
                        record["peak_memory_gib"] = max(peaks[s, row]) / 2**30
                model_records.append(with_environment(record))
            yield Measured(label, model_records)


@dataclass(frozen=True)
class ModelBenchmark(Benchmark):
    """Every (configuration, implementation, row) for ``rounds`` rounds (interleaved unless
    ``interleave`` is False, or None and the models would not fit in memory together); ``hf`` adds
    HF Llama of each configuration's dimensions. A model's records are appended as soon as its last
    round is measured, so an interrupted run keeps what it finished."""

    configs: tuple[tuple[str, ModelConfig], ...]
    rows: tuple[Row, ...]
    batch: int
    warmup: int
    steps: int
    rounds: int = 1
    interleave: bool | None = None
    hf: bool = False

    name = "model"
    title = "Model benchmark"
    progress_name = "model"
    cpu_note = CPU_NOTE

    def cases(self, device: torch.device) -> list[Subject]:
        return subjects(self.configs, IMPLEMENTATIONS if self.hf else IMPLEMENTATIONS[:1])

    def preflight(self, device: torch.device) -> None:
        if device.type == "cpu":
            check_fits_cpu(self.cases(device), self.rows, self.batch, self.interleave)

    def count(self, device: torch.device) -> int:
        return len(self.cases(device)) * len(self.rows) * self.rounds

    def measurements(self, run: Run) -> Iterator[Measured]:
        return measure_rounds(
            self.cases(run.device),
            self.rows,
            batch=self.batch,
            warmup=self.warmup,
            steps=self.steps,
            rounds=self.rounds,
            device=run.device,
            interleave=self.interleave,
        )

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        return render(read_records(results_dir / self.results_file), reports_dir)
