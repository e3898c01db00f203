"""`fastlm bench hf`: the training step of a Hugging Face causal LM as it is, patched by
`fastlm.apply_fastlm`, and patched by Liger-Kernel (when installed), in one run.

Each model is built from a family's config (`transformers` `LlamaConfig`, `Qwen3Config`, ...)
with random weights and stepped exactly as `fastlm bench model` steps fastlm's
own model (`fastlm.bench.model.measure_rounds`: interleaved rounds, the median over rounds and its
spread, tokens/s, MFU, peak memory): `model(input_ids=tokens, labels=targets).loss`, backward, and
in `train` mode fused AdamW. Only the patch differs between the rows of one shape.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.bench.model import Subject, check_fits_cpu, measure_rounds
from fastlm.bench.model_report import round_medians, speed_ratio, with_spread
from fastlm.bench.options import HF_FAMILIES, HF_SIZES
from fastlm.harness.benchmark import Benchmark, Implementation, Measured, Run
from fastlm.harness.steps import Row
from fastlm.utils.plots import grouped_bar_plot
from fastlm.utils.records import with_environment
from fastlm.utils.tables import markdown_table, present_columns

# family -> transformers (config class, model class, config values beyond the dimensions)
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    # the routers' load-balancing loss in the training loss, as fine-tuning a mixture of experts runs it
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"norm_topk_prob": True, "output_router_logits": True, "router_aux_loss_coef": 0.001},
    ),
    # Gemma 3 1B: windows of 512 in five of every six layers (local RoPE base 1e4, global 1e6),
    # queries scaled by 256 ** -0.5
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 512, "query_pre_attn_scalar": 256},
    ),
    # Gemma 2 2B: softcapped attention scores and logits; transformers computes the scores' softcap
    # with its eager attention (which keeps apply_fastlm's attention out), windows of 4096
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "attn_implementation": "eager",
            "sliding_window": 4096,
            "query_pre_attn_scalar": 256,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Granite 3's scales of the embedding, the residual branches, the attention scores and the logits
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
    ),
}

# (family, size) -> d_model, d_ff, layers, heads, key/value heads, head dim, vocabulary, tied head, rope theta:
# the published models' dimensions (Llama 3.2 1B / 3B, Llama 3.1 8B; Qwen3 1.7B / 4B / 8B; Mistral 7B v0.3
# as "8b", its smaller sizes Llama's dimensions with Mistral's vocabulary; OLMo 2 1B; Phi-3-mini (3.8B),
# Granite 3 2B, SmolLM3 3B and Gemma 2 2B as "3b"; Gemma 3 1B; Qwen3-30B-A3B as "a3b", 4 of its 48 layers, whose 30B
# parameters' training state would not fit one GPU). "tiny" is for CPU runs and tests.
TINY = (64, 128, 2, 4, 2, 16, 1000)
SIZES = {
    ("llama", "tiny"): (*TINY, True, 500000.0),
    ("llama", "1b"): (2048, 8192, 16, 32, 8, 64, 128256, True, 500000.0),
    ("llama", "3b"): (3072, 8192, 28, 24, 8, 128, 128256, True, 500000.0),
    ("llama", "8b"): (4096, 14336, 32, 32, 8, 128, 128256, False, 500000.0),
    ("qwen3", "tiny"): (*TINY, True, 1000000.0),
    ("qwen3", "1b"): (2048, 6144, 28, 16, 8, 128, 151936, True, 1000000.0),
    ("qwen3", "3b"): (2560, 9728, 36, 32, 8, 128, 151936, True, 1000000.0),
    ("qwen3", "8b"): (4096, 12288, 36, 32, 8, 128, 151936, False, 1000000.0),
    ("mistral", "tiny"): (*TINY, False, 1000000.0),
    ("mistral", "1b"): (2048, 8192, 16, 32, 8, 64, 32768, False, 1000000.0),
    ("mistral", "3b"): (3072, 8192, 28, 24, 8, 128, 32768, False, 1000000.0),
    ("mistral", "8b"): (4096, 14336, 32, 32, 8, 128, 32768, False, 1000000.0),
    ("olmo2", "tiny"): (*TINY, False, 500000.0),
    ("olmo2", "1b"): (2048, 8192, 16, 16, 16, 128, 100352, False, 500000.0),
    ("phi3", "tiny"): (*TINY, False, 10000.0),
    ("phi3", "3b"): (3072, 8192, 32, 32, 32, 96, 32064, False, 10000.0),
    ("granite", "tiny"): (*TINY, True, 5000000.0),
    ("granite", "3b"): (2048, 8192, 40, 32, 8, 64, 49155, True, 5000000.0),
    ("smollm3", "tiny"): (*TINY, True, 5000000.0),
    ("smollm3", "3b"): (2048, 11008, 36, 16, 4, 128, 128256, True, 5000000.0),
    ("gemma3_text", "tiny"): (*TINY, True, 1000000.0),
    ("gemma3_text", "1b"): (1152, 6912, 26, 4, 1, 256, 262144, True, 1000000.0),
    ("gemma2", "tiny"): (*TINY, True, 10000.0),
    ("gemma2", "3b"): (2304, 9216, 26, 8, 4, 256, 256000, True, 10000.0),
    ("qwen3_moe", "tiny"): (*TINY, False, 1000000.0),
    ("qwen3_moe", "a3b"): (2048, 6144, 4, 32, 4, 128, 151936, False, 1000000.0),
}
# (family, size) of a mixture of experts -> experts, experts per token, expert width
EXPERTS = {
    ("qwen3_moe", "tiny"): (4, 2, 32),
    ("qwen3_moe", "a3b"): (128, 8, 768),
}
# the experts implementation of the unpatched mixtures of experts: transformers' fastest
UNPATCHED_EXPERTS = "grouped_mm"


def smallest_size(family: str) -> str:
    """The family's smallest published size in `SIZES` (the GPU's default)."""
    return next(size for fam, size in SIZES if fam == family and size != "tiny")


@dataclass(frozen=True)
class HFShape:
    """The dimensions of one Hugging Face model; `fastlm.bench.model` reads the fields it shares with
    `ModelConfig` (vocab_size, context_length, d_model, num_layers, the parameter counts) for its
    memory estimate, batches and MFU."""

    family: str
    size: str
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    context_length: int
    num_experts: int = 0  # a mixture of experts (every layer's MLP): its experts, K per token, width
    experts_per_token: int = 0
    expert_d_ff: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"the query heads ({self.num_heads}) must be a multiple of the key/value heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"the head dimension must be even for RoPE, got {self.head_dim}")

    @classmethod
    def of(cls, family: str, size: str, context_length: int, **overrides) -> HFShape:
        """The published dimensions of ``family`` at ``size``, any of them overridden (None: kept)."""
        try:
            dims = SIZES[family, size]
        except KeyError:
            raise ValueError(
                f"unknown family / size {family!r} / {size!r}; families: {', '.join(HF_FAMILIES)}, "
                f"sizes: {', '.join(HF_SIZES)}"
            ) from None
        names = (
            "d_model",
            "d_ff",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "tie_word_embeddings",
            "rope_theta",
        )
        fields = dict(zip(names, dims, strict=True))
        if (family, size) in EXPERTS:
            fields |= dict(zip(("num_experts", "experts_per_token", "expert_d_ff"), EXPERTS[family, size], strict=True))
        fields |= {k: v for k, v in overrides.items() if v is not None}
        return cls(family=family, size=size, context_length=context_length, **fields)

    def num_matmul_parameters(self, *, active: bool = False) -> int:
        """Weights of every matmul: q, k, v, o projections, the SwiGLU MLP (a mixture of experts' router
        and experts: all of them, or with ``active`` the K a token uses), the LM head."""
        attention = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.d_model * self.d_ff
        if self.num_experts:
            experts = self.experts_per_token if active else self.num_experts
            mlp = self.num_experts * self.d_model + 3 * self.d_model * self.expert_d_ff * experts
        return self.num_layers * (attention + mlp) + self.vocab_size * self.d_model

    def num_parameters(self) -> int:
        embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.d_model
        norms = (2 * self.num_layers + 1) * self.d_model
        if self.family in ("qwen3", "qwen3_moe"):  # RMSNorm of each head's queries and keys
            norms += 2 * self.num_layers * self.head_dim
        if self.family in ("gemma2", "gemma3_text"):  # norms after attention and around the MLP too
            norms += 2 * self.num_layers * self.d_model
        if self.family == "gemma3_text":  # and of each head's queries and keys
            norms += 2 * self.num_layers * self.head_dim
        if self.family == "olmo2":  # RMSNorm of the whole query and key projections
            norms += self.num_layers * self.head_dim * (self.num_heads + self.num_kv_heads)
        return self.num_matmul_parameters() + embedding + norms

    def record_fields(self) -> dict:
        """The shape as flat JSON data (benchmark records), as `ModelConfig.record_fields`."""
        return dataclasses.asdict(self)


def build_model(shape: HFShape) -> torch.nn.Module:
    """The family's causal LM with ``shape``'s dimensions, random weights, SDPA attention (Gemma 2:
    eager, for its softcapped scores), no dropout."""
    config_name, model_name, extra = _CLASSES[shape.family]
    module = importlib.import_module("transformers")
    experts = {}
    if shape.num_experts:
        experts = {
            "num_experts": shape.num_experts,
            "num_experts_per_tok": shape.experts_per_token,
            "moe_intermediate_size": shape.expert_d_ff,
            "experts_implementation": UNPATCHED_EXPERTS,
        }
    config = getattr(module, config_name)(
        **{"attn_implementation": "sdpa", **extra},
        **experts,
        vocab_size=shape.vocab_size,
        hidden_size=shape.d_model,
        intermediate_size=shape.d_ff,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(shape.context_length, 2048),
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
    )
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= shape.vocab_size:
        config.pad_token_id = None  # the published model's id, past a smaller vocabulary's end
    model = getattr(module, model_name)(config)
    model.config.use_cache = False  # training: no key/value cache
    return model


def _patched_fastlm(shape: HFShape, fp8: bool = False) -> torch.nn.Module:
    from fastlm.integrations.huggingface import apply_fastlm

    model = build_model(shape)
    apply_fastlm(model, fp8=fp8)
    return model


def _patched_fastlm_fp8(shape: HFShape) -> torch.nn.Module:
    return _patched_fastlm(shape, fp8=True)


def _patched_liger(shape: HFShape) -> torch.nn.Module:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model = build_model(shape)
    _apply_liger_kernel_to_instance(model=model)
    return model


IMPLEMENTATIONS = {
    "none": Implementation("hf", build_model, "the transformers model as it is (SDPA attention)"),
    "fastlm": Implementation("hf+fastlm", _patched_fastlm, "the same after fastlm.apply_fastlm(model)"),
    "liger": Implementation("hf+liger", _patched_liger, "the same after Liger-Kernel's instance patch"),
    "fastlm-fp8": Implementation(
        "hf+fastlm+fp8", _patched_fastlm_fp8, "the same after fastlm.apply_fastlm(model, fp8=True)"
    ),
}


def missing_package(patch: str) -> str | None:
    """The pip name of the package ``patch`` needs and this machine lacks, or None."""
    package = {"liger": "liger_kernel"}.get(patch)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return package.replace("_", "-")


def missing_patch(patch: str) -> str | None:
    """Why ``patch`` cannot run here (a package missing), or None."""
    package = missing_package(patch)
    return None if package is None else f"missing: {package} is not installed"


@dataclass(frozen=True)
class HFBenchmark(Benchmark):
    """Every (shape, patch, row) for ``rounds`` rounds, interleaved when the models fit together."""

    shapes: tuple[HFShape, ...]
    patches: tuple[str, ...]
    rows: tuple[Row, ...]
    batch: int
    warmup: int
    steps: int
    rounds: int = 3

    name = "hf"
    title = "Hugging Face models: unpatched, fastlm, Liger"
    progress_name = "hf"
    cpu_note = (
        "No GPU: the models step on the CPU with fastlm's reference paths; MFU and peak memory need a GPU, "
        "and these step times say nothing about GPU step times."
    )

    def _subjects(self) -> list[Subject]:
        return [
            Subject(s.size, s, IMPLEMENTATIONS[p])
            for s in self.shapes
            for p in self.patches
            if missing_patch(p) is None
        ]

    def _missing(self) -> list[tuple[HFShape, str]]:
        return [(s, p) for s in self.shapes for p in self.patches if missing_patch(p) is not None]

    def preflight(self, device: torch.device) -> None:
        if device.type == "cpu":
            check_fits_cpu(self._subjects(), self.rows, self.batch, None, smaller="--size, --batch or --seq")

    def count(self, device: torch.device) -> int:  # one more for the step that records the missing baselines
        return len(self._subjects()) * len(self.rows) * self.rounds + bool(self._missing())

    def measurements(self, run: Run) -> Iterator[Measured]:
        missing = self._missing()
        if missing:
            yield Measured(
                "not installed, left out: " + ", ".join(sorted({missing_package(p) for _, p in missing})),
                [
                    with_environment(
                        {
                            "op": "hf",
                            "implementation": IMPLEMENTATIONS[p].name,
                            **dataclasses.asdict(s),
                            "batch": self.batch,
                            **dataclasses.asdict(row),
                            "status": missing_patch(p),
                        }
                    )
                    for s, p in missing
                    for row in self.rows
                ],
            )
        for measured in measure_rounds(
            self._subjects(),
            self.rows,
            batch=self.batch,
            warmup=self.warmup,
            steps=self.steps,
            rounds=self.rounds,
            device=run.device,
            errors_as_status=True,
        ):
            yield Measured(measured.label, [{**r, "op": "hf"} for r in measured.records])

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        return render(self.latest_records(results_dir), reports_dir)


COLUMNS = [
    ("family", "family"),
    ("size", "size"),
    ("implementation", "model"),
    ("mode", "mode"),
    ("compile", "compile"),
    ("step_ms", "step ms: median (rounds min-max)"),
    ("tokens_per_s", "tokens/s"),
    ("mfu_percent", "MFU %"),
    ("peak_memory_gib", "peak GiB"),
    ("vs_hf", "vs hf"),
    ("vs_liger", "vs hf+liger"),
    ("status", "status"),
]


def _display(record: dict, group: Sequence[dict]) -> dict:
    row = dict(record)
    if record.get("status") != "ok":
        return row
    medians = round_medians(record)
    row["step_ms"] = with_spread(record["median_ms"], min(medians), max(medians))
    row["tokens_per_s"] = f"{record['tokens_per_s']:,.0f}"
    if record.get("mfu") is not None:
        row["mfu_percent"] = f"{100 * record['mfu']:.1f}"
    if record.get("peak_memory_gib") is not None:
        row["peak_memory_gib"] = f"{record['peak_memory_gib']:.1f}"
    for column, baseline_name in (("vs_hf", "hf"), ("vs_liger", "hf+liger")):
        baseline = next((r for r in group if r["implementation"] == baseline_name and r.get("status") == "ok"), None)
        if baseline is not None and baseline is not record:
            row[column] = with_spread(*speed_ratio(record, baseline), unit="x")
    return row


def render(records: list[dict], reports_dir: Path) -> str:
    """One table of the run (ratios are per-round pairs of interleaved rounds: median and min-max) and
    a plot of tokens/s per (shape, mode, compile)."""
    if not records:
        return "No records yet: run `fastlm bench hf`.\n"
    first = next((r for r in records if r.get("status") == "ok"), records[0])
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(
            (r["family"], r["size"], r["num_layers"], r["mode"], r["precision"], r["compile"]), []
        ).append(r)
    displayed = [_display(r, group) for group in groups.values() for r in group]
    lines = [
        f"Device: {first['gpu']} · torch {first['torch']} · git {first['git_sha']} · {first['date']} · batch "
        f"{first['batch']} x {first['context_length']} tokens, {first.get('precision', '')}, "
        f"{first.get('warmup', '?')} warm-up + {first.get('steps', '?')} timed steps per round, "
        f"{first.get('rounds', '?')} rounds ({first.get('schedule', '')})",
        "",
        markdown_table(displayed, present_columns(displayed, COLUMNS)),
        "",
    ]
    labels = [f"{f} {s} L{n} {m} {c}" for f, s, n, m, _, c in groups]
    names = list(dict.fromkeys(r["implementation"] for r in records))
    series = {
        name: [
            next((r["tokens_per_s"] for r in group if r["implementation"] == name and r.get("status") == "ok"), None)
            for group in groups.values()
        ]
        for name in names
    }
    if any(v is not None for values in series.values() for v in values):
        plot = grouped_bar_plot(
            reports_dir / "hf.png",
            labels,
            series,
            ylabel="tokens/s",
            title=f"HF models' training step, {first['gpu'].removeprefix('NVIDIA ')}",
        )
        lines.append(f"![tokens/s]({plot.name})")
    return "\n".join(lines)
