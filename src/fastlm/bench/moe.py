"""`fastlm bench moe`: a mixture-of-experts layer's experts, forward and fwd+bwd, for every implementation.

Protocol (one run, one device, every implementation side by side):
- a layer shape (experts E, top-k K, width D, expert width I) and T tokens; x (T, D) ~ N(0, 1),
  gate_up (E, 2I, D) ~ N(0, 1 / D), down (E, D, I) ~ N(0, 1 / I), all bf16 and requiring grad, as
  the routing weights (T, K) are (softmax of random logits, so the router's gradient is computed);
- routing "uniform": each token's K experts at random (every expert about T K / E pairs); "skewed":
  expert 0 carries 4x the mean load T K / E (forced on some tokens, `routes`);
- the transformers implementations run its Qwen3-MoE experts module (Mixtral's is the same
  computation) with `_experts_implementation` "eager" (a loop over the experts) or "grouped_mm";
  "grouped_mm compiled" is torch.compile of the latter; fastlm is `fastlm.ops.moe.moe_experts`;
- fwd: the output with autograd recording; fwd+bwd: `out.backward(dy)`, the gradients dropped
  before each call (`measure`: median, p20, p80; warm-up and compilation excluded);
- TFLOP/s count the active FLOPs, 6 T K D I forward and 18 T K D I forward and backward, for every
  implementation alike, and their fraction of the bf16 matmul rate measured in the same run;
- memory (CUDA): the peak allocated during one fwd+bwd above what was allocated before, without the
  gradients (`peak_backward_memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.bench.bandwidth import CPU_NOTE
from fastlm.bench.options import MOE_LAYERS, MOE_TOKENS
from fastlm.harness.benchmark import Benchmark, Implementation, Run
from fastlm.harness.timing import measure, peak_backward_memory, stage_times
from fastlm.utils.plots import bar_series, time_and_memory_plots
from fastlm.utils.tables import device_line, markdown_table


@dataclass(frozen=True)
class Layer:
    name: str
    experts: int  # E
    top_k: int  # K
    width: int  # D
    expert_width: int  # I


# The published layer shapes (config.json: num_experts / num_local_experts, num_experts_per_tok,
# hidden_size, moe_intermediate_size / intermediate_size). GPT-OSS's experts have biases and a
# clamped SwiGLU; its shape is measured here with the plain SwiGLU.
LAYERS = {
    "qwen3-30b-a3b": Layer("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "mixtral-8x7b": Layer("Mixtral-8x7B", 8, 2, 4096, 14336),
    "gpt-oss-20b": Layer("GPT-OSS-20B", 32, 4, 2880, 2880),
}
ROUTINGS = ("uniform", "skewed")
CPU_LAYER = Layer("tiny", 8, 2, 64, 32)  # reduced run on machines without a GPU
CPU_TOKENS = 64
DTYPE = torch.bfloat16
SKEW = 4  # the skewed routing's hot expert carries SKEW times the mean load

# (x, index, weights) -> out, for the expert weights it was made with
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MakeFn = Callable[[torch.Tensor, torch.Tensor], ExpertsFn]  # (gate_up, down) -> ExpertsFn


@dataclass(frozen=True)
class Case:
    layer: Layer
    tokens: int
    routing: str


def active_flops(case: Case, stage: str) -> int:
    """The experts' matmuls on the routed pairs: gate_up (4 S D I) and down (2 S D I) forward, twice
    that backward, S = T K."""
    forward = 6 * case.tokens * case.layer.top_k * case.layer.width * case.layer.expert_width
    return {"fwd": forward, "fwd_bwd": 3 * forward}[stage]


def routes(case: Case, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index (T, K) int64 and the routing weights (T, K) in DTYPE, requiring grad."""
    experts, k = case.layer.experts, case.layer.top_k
    scores = torch.rand(case.tokens, experts, generator=generator)
    if case.routing == "skewed":
        # expert 0 forced on a fraction f of the tokens, and picked by chance (K / E) by the rest:
        # f + (1 - f) K / E = SKEW K / E, SKEW x the mean load T K / E
        forced = (SKEW - 1) * k / (experts - k) if experts > k else 0.0
        hot = torch.rand(case.tokens, generator=generator) < min(1.0, forced)
        scores[hot, 0] = 2.0
    index = scores.topk(k, dim=1).indices
    weights = torch.randn(case.tokens, k, generator=generator).softmax(dim=-1)
    return index.to(device), weights.to(device, DTYPE).requires_grad_()


def _hf(implementation: str, compiled: bool = False) -> Callable[[Case], MakeFn | str]:
    def make(case: Case) -> MakeFn | str:
        try:
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        except ImportError:
            return "missing: transformers is not installed"
        layer = case.layer
        config = Qwen3MoeConfig(
            hidden_size=layer.width,
            moe_intermediate_size=layer.expert_width,
            num_experts=layer.experts,
            num_experts_per_tok=layer.top_k,
            hidden_act="silu",
        )
        config._experts_implementation = implementation

        def bind(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertsFn:
            with torch.device("meta"):  # the module's own parameters are replaced by the run's tensors
                experts = Qwen3MoeExperts(config)
            del experts.gate_up_proj, experts.down_proj
            experts.gate_up_proj, experts.down_proj = gate_up, down
            if compiled:
                torch._dynamo.reset()  # a fresh compilation per case
                return torch.compile(experts)
            return experts

        return bind

    return make


def _fastlm(_case: Case) -> MakeFn:
    from fastlm.ops.moe import moe_experts

    return lambda gate_up, down: lambda x, index, weights: moe_experts(x, gate_up, down, index, weights)


IMPLEMENTATIONS = (
    Implementation("hf eager", _hf("eager"), "transformers' loop over the experts"),
    Implementation("hf grouped_mm", _hf("grouped_mm"), "transformers' grouped_mm backend (torch grouped GEMMs)"),
    Implementation("hf grouped_mm compiled", _hf("grouped_mm", True), "torch.compile of it", needs_gpu=True),
    Implementation("fastlm", _fastlm, "fastlm.ops.moe.moe_experts"),
)

TABLE_COLUMNS = [
    ("layer", "layer"),
    ("tokens", "T"),
    ("routing", "routing"),
    ("implementation", "implementation"),
    ("fwd_ms", "fwd ms"),
    ("fwd_bwd_ms", "fwd+bwd ms"),
    ("vs_eager", "fwd+bwd vs hf eager"),
    ("vs_grouped_mm", "fwd+bwd vs hf grouped_mm"),
    ("fwd_bwd_tflops", "fwd+bwd active TFLOP/s"),
    ("percent_of_matmul", "% of measured matmul"),
    ("peak_excluding_grads_gib", "peak GiB (without grads)"),
    ("status", "status"),
]


def _key(record: dict) -> tuple:
    return record["layer"], record["tokens"], record["routing"]


def table_rows(records: list[dict]) -> list[dict]:
    """The records with their fwd+bwd speed-ups over transformers' two backends in the same case."""
    ok = {(_key(r), r["implementation"]): r for r in records if r["status"] == "ok"}
    rows = []
    for r in records:
        row = dict(r)
        if r["status"] == "ok":
            row["percent_of_matmul"] = 100 * r["fwd_bwd_tflops"] / r["matmul_tflops_measured"]
            for column, baseline in (("vs_eager", "hf eager"), ("vs_grouped_mm", "hf grouped_mm")):
                base = ok.get((_key(r), baseline))
                if base is not None:
                    row[column] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        rows.append(row)
    return rows


class MoEBenchmark(Benchmark):
    name = "moe"
    title = "Mixture-of-experts experts benchmark"
    progress_name = "moe"
    cpu_note = CPU_NOTE
    measures_ceilings = True

    def __init__(self, layers: tuple[str, ...] = MOE_LAYERS, tokens: tuple[int, ...] = MOE_TOKENS) -> None:
        self.layers, self.tokens = layers, tokens

    def cases(self, device: torch.device) -> list[Case]:
        if device.type != "cuda":
            return [Case(CPU_LAYER, CPU_TOKENS, routing) for routing in ROUTINGS]
        return [Case(LAYERS[name], t, routing) for name in self.layers for t in self.tokens for routing in ROUTINGS]

    def implementations(self, case: Case) -> tuple[Implementation, ...]:
        return IMPLEMENTATIONS

    def describe(self, case: Case, implementation: Implementation, run: Run) -> dict:
        layer = case.layer
        return {
            "op": "moe_experts",
            "layer": layer.name,
            "experts": layer.experts,
            "top_k": layer.top_k,
            "width": layer.width,
            "expert_width": layer.expert_width,
            "tokens": case.tokens,
            "routing": case.routing,
            "dtype": str(DTYPE).removeprefix("torch."),
            "implementation": implementation.name,
            "description": implementation.description,
            "matmul_tflops_measured": run.ceilings["matmul_tflops"],
        }

    def label(self, case: Case, implementation: Implementation) -> str:
        return f"{case.layer.name} T={case.tokens} {case.routing} {implementation.name}"

    def measure(self, case: Case, bind: MakeFn, run: Run) -> dict:
        layer, device = case.layer, run.device
        generator = torch.Generator().manual_seed(0)

        def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(shape, generator=generator) * scale).to(device, DTYPE).requires_grad_()

        x = leaf(case.tokens, layer.width)
        gate_up = leaf(layer.experts, 2 * layer.expert_width, layer.width, scale=layer.width**-0.5)
        down = leaf(layer.experts, layer.width, layer.expert_width, scale=layer.expert_width**-0.5)
        index, weights = routes(case, device, generator)
        experts = bind(gate_up, down)
        dy = torch.randn_like(x)
        leaves = [x, gate_up, down, weights]
        result = {"status": "ok"}
        for stage, fn in (
            ("fwd", lambda: experts(x, index, weights)),
            ("fwd_bwd", lambda: experts(x, index, weights).backward(dy)),
        ):
            timing = measure(fn, device, grad_to_none=leaves)
            result.update(stage_times(stage, timing))
            result[f"{stage}_tflops"] = active_flops(case, stage) / (timing.median_ms * 1e-3) / 1e12
        if device.type == "cuda":
            result.update(peak_backward_memory(lambda: (experts(x, index, weights) * dy).sum(), leaves))
        return result

    def render(self, results_dir: Path, reports_dir: Path) -> str:
        """Markdown section (device line, table, plot links) for the latest run; writes the PNG plots."""
        records = self.latest_records(results_dir)
        if not records:
            return "No mixture-of-experts records yet: run `fastlm bench moe`.\n"
        first = records[0]
        groups = list(dict.fromkeys(f"{r['layer']} T={r['tokens']} {r['routing']}" for r in records))
        names = [impl.name for impl in IMPLEMENTATIONS]

        def series(key):
            return bar_series(records, groups, lambda r: f"{r['layer']} T={r['tokens']} {r['routing']}", names, key)

        parts = [
            f"{device_line(first)} · bf16 inputs and expert weights, SwiGLU experts · measured matmul rate "
            f"{first['matmul_tflops_measured']:.3g} TFLOP/s · TFLOP/s count the active FLOPs (18 T K D I "
            f"fwd+bwd) · skewed: one expert with {SKEW}x the mean load",
            *([CPU_NOTE] if first["gpu"] == "cpu" else []),
            markdown_table(table_rows(records), TABLE_COLUMNS),
            *time_and_memory_plots(reports_dir, "moe", groups, series, f"MoE experts fwd+bwd, bf16 ({first['gpu']})"),
        ]
        return "\n\n".join(parts)
