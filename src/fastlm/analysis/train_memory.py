"""Per-GPU peak memory and communication of one `fastlm train` step: the model behind `fastlm analyze memory`.

Notation: P parameters (`ModelConfig.num_parameters`), L blocks of P_b parameters each
(`ModelConfig.num_block_parameters`), P_mm = L (4 d^2 + 3 d F) their matmul weights, P_root = 2 V d + d
the embedding, final norm and LM head; d = d_model, F = d_ff, H heads, V vocabulary; T = micro-batch x
context, the tokens of one micro-batch on one GPU; N GPUs; P_u the parameters of the largest fsdp
unit (`fastlm.distributed.wrappers.sharding_units`: consecutive blocks of at least --bucket-mb MB in
bf16). 1 GiB = 2^30 bytes; communication in GB = 1e9 bytes, as link bandwidths are quoted.

Assumptions, all of them:
- The step is `fastlm train --precision bf16` (its GPU default): bf16 autocast over fp32 weights,
  PyTorch's AdamW with two fp32 moments, gradients averaged in fp32; plain causal attention
  (--no-documents, or windows without a document boundary; a sliding window only with fastlm
  attention), attention sdpa or fastlm (naive materializes the scores, not counted here).
- Memory is what PyTorch's allocator hands out, torch.cuda.max_memory_allocated (what `fastlm
  train` records as peak_memory_gib). The CUDA context, kernel images and NCCL's buffers live
  outside the allocator: the table adds CUDA_CONTEXT_BYTES for them, a stated allowance, not a
  measurement; neither is allocator fragmentation (reserved beyond allocated) counted.
- The peak comes from the second step on (AdamW's moments exist) at one of two moments:
  (1) forward -> backward: everything the backward reads is held and no gradient exists yet;
  (2) end of backward: every gradient exists and the activations are gone. In between, the
  backward frees a block's activations as it adds that block's gradients, a linear exchange, so
  the larger end is the peak. Transients of the one block being worked on are added to both.
- State per parameter (`fastlm.settings.STATE_BYTES` of bf16): fp32 weights 4 B, gradients 4 B,
  AdamW moments 8 B, 16 P in all (`ParallelMode.state_bytes_per_parameter`). none and
  ddp hold all of it on every GPU (ddp all-reduces the gradients in place); fsdp shards all of it
  over N. With gradient accumulation (micro-batches after the first) the gradients of the earlier
  ones are held through the forward: 4 P (none, ddp), and under fsdp also 4 P, not 4 P / N: FSDP2
  keeps every unit's unsharded gradient in fp32 (the reduce dtype) until the last micro-batch.
- Saved activations per block and token (bytes), under bf16 autocast:
    compile (torch.compile; what Inductor's partitioner keeps, read from the tensors the compiled
    model saved for its backward in a CPU run; --compile cudagraphs is not counted):
      the residual stream, input of each norm, fp32          2 x 4d
      each norm's output, bf16                               2 x 2d
      q, k, v after RoPE                                     3 x 2d
      attention output, and its logsumexp (fp32 per head)    2d + 4H
      the attention branch's output o_proj(...)              2d
      each norm's rstd (fp32)                                2 x 4
      MLP: gate w1 x, up w3 x, and silu(gate) * up           3 x 2F
      = 22d + 6F + 4H + 8, for either kernel set (under compile the norms and RoPE are PyTorch
      ops, and flash attention saves what SDPA does);
    eager, PyTorch norm (kernels torch): each norm also keeps its normalized fp32 tensor (2 x 4d)
      and autocast casts its output to bf16 once per reader (q, k, v; w1, w3: 5 x 2d instead of
      2 x 2d); silu(gate) is a fourth F tensor; SDPA's output is o_proj's input as a view:
      34d + 8F + 4H + 8;
    eager, fused norm (kernels fastlm): each norm keeps its input and its bf16 output (2 x 6d);
      flash attention's output is copied for o_proj (2 x 2d); the fused SwiGLU saves gate and up
      only (its backward recomputes silu): 22d + 6F + 4H + 8.
    a mixture of experts' block (--mlp fastlm; K of E experts of width I, S shared ones): the same
      but for 6F, in its place what `fastlm.layers.moe.MoEMLP` saves per token: each of the K pairs
      its projections GU and H (6I) and output Y (2d), its expert index (8), routing weight (4),
      sorted order (8), token and position (4 + 4), a weight before renormalizing (4); the
      router's fp32 softmax, the load-balancing loss's and the z-loss's input (12E) and 12 more;
      the shared experts 6 S I: K (6I + 2d + 32) + 12E + 12 + 6 S I (read off the saved tensors in
      a CPU run; the same count under compile, the experts being one opaque op there).
      Other mixes of --norm, --attention and --mlp add up the same parts.
- autocast's bf16 copies of the fp32 weights are saved for the backward: 2 P_mm for the blocks
  under none and ddp (fsdp gathers them in bf16 already), 2 V d for the LM head with the torch loss
  (fastlm's fused loss takes its gradients in the forward and drops its copy).
- --recompute (torch.utils.checkpoint around each block): a block keeps only its input, 4d per
  token in fp32; the backward runs one block's forward again, so one block's activations (and
  under none and ddp its weight copies, 2 P_mm / L) are added at both moments.
- LM head and loss, per token unless said (the root, run eager under fsdp, compiled with the rest
  of the model otherwise): the final norm as one norm above (compiled or fused: 4d + 2d; eager
  PyTorch: 4d + 4d + 2d); torch loss compiled: the bf16 logits and their bf16 gradient, 4V; torch
  loss eager: autocast runs the loss in fp32, so the saved log-softmax (4V) meets the gradients of
  nll_loss and log_softmax (2 x 4V): 12V; fastlm's fused loss: the hidden states' gradient 2d, the
  LM head's fp32 gradient 4 V d (under compile once more as an fp32 temporary), and one chunk of
  bf16 logits, T x 2V up to LINEAR_XENT_CHUNK_BYTES.
- fsdp (`fastlm.distributed.wrappers.FSDP.wrap`): units gather their weights in bf16. While all blocks
  together take at most GATHERED_BYTES_LIMIT in bf16 (`keeps_gathered`) they stay gathered from
  forward to backward: 2 (P_b L) at the forward -> backward moment; otherwise about two units are
  in flight at either moment (the one computing and the one prefetched): 2 x 2 P_u. The root stays
  gathered in fp32: 4 P_root (N - 1) / N beyond its shard. At the end of the backward: one unit's
  bf16 gradients and one fp32 reduce-scatter input (6 P_u), and the root's unsharded fp32 gradients
  (4 P_root), reduced last. These transients are summed though they do not all peak at once (the
  last units' gradient shards do not exist yet while theirs do): an over-count of up to 8 P_u / N.
- Communication per GPU and step, ring collectives (each GPU sends (N - 1) / N of the gathered or
  reduced bytes per all-gather or reduce-scatter, twice that per all-reduce); A = micro-batches
  per step. ddp: one all-reduce of the fp32 gradients, 2 (N - 1) / N x 4 P. fsdp: per micro-batch
  an all-gather of the blocks' bf16 weights in the forward, and again in the backward for the
  units resharded after forward (all but the last, unless kept gathered); the fp32 root gathered
  once per micro-batch; one reduce-scatter of all fp32 gradients per step. With reduce_dtype bf16
  (--reduce-dtype bf16) the gradients cross the wire in bf16: half the all-reduce's or the
  reduce-scatter's bytes. The memory terms stay those of fp32 reduction (bf16 changes only
  transients at the end of the backward: fsdp's reduce-scatter input, the DDP variants' buckets).
Measured against: tests/analysis/test_train_memory.py (the records of `fastlm train` and `fastlm
bench model` in benchmarks/results/).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from rich.table import Table

from fastlm.analysis.tables import add_columns, gib
from fastlm.distributed.wrappers import ParallelMode, keeps_gathered, parallel_mode, sharding_units
from fastlm.model.config import ModelConfig
from fastlm.settings import DEFAULT_BUCKET_MB, PARALLEL, REDUCE_DTYPES, STATE_BYTES, ParallelSpec, bucket_mb_in_use

PARALLEL_MODES = ("none", "ddp", "fsdp")  # the `fastlm train --parallel` modes counted here
COMPILE_MODES = ("eager", "compile")  # the `fastlm train --compile` modes counted here
FP32, BF16 = 4, 2  # bytes per element
STATE = STATE_BYTES["bf16"]  # the training state per parameter of the step counted here
# Outside PyTorch's allocator, so in no record of max_memory_allocated: the CUDA context, kernel
# images, cuBLAS and NCCL handles and NCCL's buffers. A stated allowance, not measured here.
CUDA_CONTEXT_BYTES = 2**30
# One chunk of logits of fastlm.linear_cross_entropy on H100 and H200 (its _CHUNK_BYTES[90]; tests
# hold the two equal): without importing torch, which `fastlm analyze` never does.
LINEAR_XENT_CHUNK_BYTES = 2**29


@dataclass(frozen=True)
class TrainStep:
    """One GPU's share of a `fastlm train` step: ``config`` (dimensions, kernel switches,
    context_length, recompute), ``micro_batch`` sequences per micro-batch, ``accumulation``
    micro-batches per optimizer step, ``gpus`` processes of --parallel ``parallel``, --compile
    ``compile`` and, for fsdp, units of at least ``bucket_mb`` MB."""

    config: ModelConfig
    micro_batch: int = 8
    gpus: int = 1
    parallel: str = "none"
    compile: str = "compile"
    accumulation: int = 1
    bucket_mb: float = DEFAULT_BUCKET_MB["fsdp"]
    reduce_dtype: str = "fp32"  # what the gradients are averaged in (fastlm train --reduce-dtype)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "gpus", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 < self.bucket_mb < math.inf:
            raise ValueError(f"bucket_mb must be a positive finite number of MB, got {self.bucket_mb!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {self.parallel!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if not PARALLEL[self.parallel].processes and self.gpus != 1:
            raise ValueError(f"parallel {self.parallel} runs one process: gpus must be 1, got {self.gpus}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {self.reduce_dtype!r}")
        if self.reduce_dtype != "fp32" and not PARALLEL[self.parallel].processes:
            raise ValueError(f"parallel {self.parallel} averages no gradients: reduce_dtype must stay fp32")
        if self.config.num_experts and self.config.kernels.mlp == "torch":
            raise ValueError("mlp torch runs the experts as a loop, whose saved tensors are not counted: use fastlm")
        if self.config.kernels.attention == "naive":
            raise ValueError("attention naive materializes the scores, not counted here: use sdpa or fastlm")
        if self.config.window is not None and self.config.kernels.attention != "fastlm":
            raise ValueError("window needs attention fastlm: sdpa takes sliding windows as masks, not counted here")

    @property
    def tokens(self) -> int:
        """T: tokens of one micro-batch on one GPU."""
        return self.micro_batch * self.config.context_length

    @property
    def mode(self) -> ParallelMode:
        """The --parallel mode as `fastlm train` runs it."""
        return parallel_mode(
            ParallelSpec(self.parallel, bucket_mb_in_use(self.parallel, self.bucket_mb), self.reduce_dtype)
        )

    @property
    def sharded(self) -> bool:
        """Whether the GPUs divide the training state (fsdp), or each holds all of it."""
        return PARALLEL[self.parallel].shards_state

    @property
    def shards(self) -> int:
        """How many GPUs share the training state: N under fsdp, else each GPU holds all of it."""
        return self.gpus if self.sharded else 1

    @property
    def compiled_root(self) -> bool:
        """Whether the embedding, final norm and loss run compiled: `fastlm train` compiles the
        whole model, but under fsdp only the blocks."""
        return self.compile == "compile" and self.mode.compiles_whole_model


@dataclass(frozen=True)
class Term:
    """Bytes one GPU holds for one thing at the two moments that can be the peak."""

    what: str
    formula: str
    forward_to_backward: float  # as the backward starts
    end_of_backward: float  # as it ends


@dataclass(frozen=True)
class Transfer:
    """Bytes one GPU sends per optimizer step in one kind of collective."""

    what: str
    formula: str
    bytes_per_step: float


@dataclass(frozen=True)
class MemoryPrediction:
    terms: tuple[Term, ...]

    @property
    def forward_to_backward(self) -> float:
        return sum(t.forward_to_backward for t in self.terms)

    @property
    def end_of_backward(self) -> float:
        return sum(t.end_of_backward for t in self.terms)

    @property
    def peak(self) -> float:
        """Predicted max_memory_allocated of one GPU."""
        return max(self.forward_to_backward, self.end_of_backward)

    @property
    def moment(self) -> str:
        return "forward -> backward" if self.forward_to_backward >= self.end_of_backward else "end of backward"


# ---------------------------------------------------------------------------------------------
# Counts
# ---------------------------------------------------------------------------------------------


def block_matmul_parameters(config: ModelConfig) -> int:
    """P_mm: the blocks' matmul weights, L (4 d^2 + 3 d F) (every parameter but the norm weights;
    a mixture of experts' blocks all their experts)."""
    return config.num_blocks_parameters() - config.num_layers * 2 * config.d_model


def root_parameters(config: ModelConfig) -> int:
    """P_root: the embedding, the final norm and the LM head, 2 V d + d."""
    return config.num_parameters() - config.num_blocks_parameters()


@dataclass(frozen=True)
class _Weights:
    """Stands in for a block where `fastlm.distributed.wrappers` sizes modules (the numel of their
    parameters), so the units here are the trainer's own, computed without torch."""

    count: int

    def parameters(self) -> list[_Weights]:
        return [self]

    def numel(self) -> int:
        return self.count


_BF16_DTYPE = SimpleNamespace(itemsize=BF16)  # stands in for torch.bfloat16, fsdp's gather dtype


def fsdp_units(config: ModelConfig, bucket_mb: float) -> list[int]:
    """Parameters of each fsdp unit, in forward order (`sharding_units` of the blocks in bf16)."""
    blocks = [_Weights(config.num_block_parameters(layer)) for layer in range(config.num_layers)]
    return [sum(block.count for block in unit) for unit in sharding_units(blocks, bucket_mb, _BF16_DTYPE)]


def fsdp_keeps_gathered(config: ModelConfig) -> bool:
    """Whether fsdp keeps every block gathered from forward to backward (`keeps_gathered`)."""
    blocks = _Weights(config.num_blocks_parameters())
    return keeps_gathered(SimpleNamespace(blocks=blocks), _BF16_DTYPE)


def block_activations(config: ModelConfig, compiled: bool) -> tuple[int, str]:
    """Bytes one block saves for its backward per token, and the formula (module docstring)."""
    d, f, h = config.d_model, config.d_ff, config.num_heads
    kernels = config.kernels  # fastlm or auto: the fused kernel in eager mode
    if compiled:
        k, mlp = 22, 6
    else:
        k = (12 if kernels.norm != "torch" else 26) + 6 + 2 + (2 if kernels.attention == "fastlm" else 0)
        # the MLP's bf16 (T, F) tensors: gate and up, and the product w2 reads; PyTorch's silu(gate) too
        mlp = 6 if kernels.mlp != "torch" else 8
    if not config.num_experts:
        return k * d + mlp * f + 4 * h + 8, f"{k}d + {mlp}F + 4H + 8"
    return _mixed_block_activations(config, k, mlp)


def _mixed_block_activations(config: ModelConfig, k: int, mlp: int) -> tuple[int, str]:
    """`block_activations` of a mixture of experts: the mean over the blocks (rounded up), its MoE
    blocks' MLP term per token (module docstring, read off the tensors `MoEMLP` saves) in place of
    the dense blocks' mlp F."""
    d, f, h = config.d_model, config.d_ff, config.num_heads
    e, top, width, shared = config.num_experts, config.experts_per_token, config.expert_width, config.shared_experts
    experts = top * (6 * width + 2 * d + 32) + 12 * e + 12 + 6 * shared * width
    formula = "K (6I + 2d + 32) + 12E + 12" + (" + 6 S I" if shared else "")
    moe, dense = len(config.moe_layers), config.num_layers - len(config.moe_layers)
    total = moe * (k * d + 4 * h + 8 + experts) + dense * (k * d + mlp * f + 4 * h + 8)
    if dense:
        formula = f"mean over the blocks of MoE {formula}, dense {mlp}F"
    return -(-total // config.num_layers), f"{k}d + 4H + 8 + {formula}"


def head_activations(step: TrainStep) -> tuple[int, str]:
    """Bytes of the final norm, LM head and loss held as the backward starts, and the formula."""
    config, t = step.config, step.tokens
    d, v = config.d_model, config.vocab_size
    compiled = step.compiled_root
    norm_d = 6 if compiled or config.kernels.norm != "torch" else 10
    if config.kernels.loss == "torch":
        per_class = 4 if compiled else 12
        return t * (norm_d * d + per_class * v), f"T ({norm_d}d + {per_class}V)"
    chunk = min(t * BF16 * v, LINEAR_XENT_CHUNK_BYTES)
    weight_gradients = (2 if compiled else 1) * FP32 * v * d
    formula = f"T {norm_d + 2}d + {8 if compiled else 4} V d + chunk"
    return t * (norm_d + 2) * d + weight_gradients + chunk, formula


def memory_terms(step: TrainStep) -> MemoryPrediction:
    """What one GPU holds at the two moments that can be the peak, term by term."""
    config, fsdp = step.config, step.sharded  # sharded: fsdp, whose units gather bf16 weights
    p, t, d, v = config.num_parameters(), step.tokens, config.d_model, config.vocab_size
    shards = step.shards
    over = " / N" if fsdp else ""
    sharded = " sharded" if fsdp else ""
    terms = [
        Term(
            f"weights, fp32{sharded}",
            f"{STATE.weights} P{over}",
            STATE.weights * p / shards,
            STATE.weights * p / shards,
        ),
        Term(
            f"AdamW moments, fp32{sharded}",
            f"{STATE.optimizer} P{over}",
            STATE.optimizer * p / shards,
            STATE.optimizer * p / shards,
        ),
    ]
    accumulating = step.accumulation > 1
    gradients = STATE.gradients * p / shards
    if accumulating and not fsdp:
        terms.append(Term("gradients, fp32 (also between micro-batches)", f"{STATE.gradients} P", gradients, gradients))
    else:
        terms.append(Term(f"gradients, fp32{sharded}", f"{STATE.gradients} P{over}", 0, gradients))
    if accumulating and fsdp:
        terms.append(
            Term("unsharded fp32 gradients between micro-batches", f"{STATE.gradients} P", STATE.gradients * p, 0)
        )
    block_copies = 0 if fsdp or config.recompute else BF16 * block_matmul_parameters(config)
    head_copy = BF16 * v * d if config.kernels.loss == "torch" else 0
    if block_copies or head_copy:
        formula = " + ".join(f for f, n_bytes in (("2 P_mm", block_copies), ("2 V d", head_copy)) if n_bytes)
        terms.append(Term("autocast's bf16 weight copies", formula, block_copies + head_copy, 0))
    if fsdp:
        terms += _fsdp_terms(step)
    per_block, block_formula = block_activations(config, step.compile == "compile")
    if config.recompute:
        inputs = t * config.num_layers * FP32 * d
        terms.append(Term("saved block inputs, fp32 (recompute)", "T L 4d", inputs, 0))
        again = t * per_block + (0 if fsdp else BF16 * block_matmul_parameters(config) / config.num_layers)
        formula = f"T ({block_formula})" + ("" if fsdp else " + 2 P_mm / L")
        terms.append(Term("one block's forward, run again", formula, again, again))
    else:
        saved = t * config.num_layers * per_block
        terms.append(Term("saved activations", f"T L ({block_formula})", saved, 0))
    head, head_formula = head_activations(step)
    terms.append(Term(f"LM head and {config.kernels.loss} loss", head_formula, head, 0))
    return MemoryPrediction(tuple(terms))


def _fsdp_terms(step: TrainStep) -> list[Term]:
    """Gathered weights and reduce buffers of fsdp (module docstring)."""
    config, n = step.config, step.gpus
    units = sorted(fsdp_units(config, step.bucket_mb), reverse=True)
    in_flight = BF16 * sum(units[:2])  # the unit computing and the one prefetched
    flight = "2 x 2 P_u" if len(units) > 1 else "2 P_u"
    if fsdp_keeps_gathered(config):
        gathered = Term("gathered bf16 weights (all kept)", f"2 L P_b, then {flight}", BF16 * sum(units), in_flight)
    else:
        gathered = Term("gathered bf16 weights", flight, in_flight, in_flight)
    root = root_parameters(config)
    root_gathered = FP32 * root * (n - 1) / n
    return [
        gathered,
        Term("root gathered, fp32", "4 P_root (N-1) / N", root_gathered, root_gathered),
        Term("gradient reduce buffers", "6 P_u + 4 P_root", 0, 3 * BF16 * units[0] + FP32 * root),
    ]


def communication(step: TrainStep) -> list[Transfer]:
    """Bytes one GPU sends per optimizer step, by collective (ring algorithms; module docstring)."""
    config, n, a = step.config, step.gpus, step.accumulation
    ring = (n - 1) / n
    p = config.num_parameters()
    wire, wire_bytes = step.reduce_dtype, FP32 if step.reduce_dtype == "fp32" else BF16
    if not PARALLEL[step.parallel].processes:
        return []
    if not step.sharded:
        all_reduce = 2 * ring * wire_bytes * p
        return [Transfer(f"all-reduce of the {wire} gradients", f"2 (N-1)/N x {wire_bytes} P", all_reduce)]
    units = fsdp_units(config, step.bucket_mb)
    blocks = sum(units)
    again = 0 if fsdp_keeps_gathered(config) else blocks - units[-1]  # the last unit stays gathered
    per_micro_batch = f"{a} x " if a > 1 else ""
    return [
        Transfer("all-gather bf16 blocks, forward", f"{per_micro_batch}(N-1)/N x 2 L P_b", a * ring * BF16 * blocks),
        Transfer(
            "all-gather bf16 blocks, backward",
            f"{per_micro_batch}(N-1)/N x 2 (L P_b - last unit)" if again else "none: kept gathered",
            a * ring * BF16 * again,
        ),
        Transfer(
            "all-gather fp32 root", f"{per_micro_batch}(N-1)/N x 4 P_root", a * ring * FP32 * root_parameters(config)
        ),
        Transfer(f"reduce-scatter {wire} gradients", f"(N-1)/N x {wire_bytes} P", ring * wire_bytes * p),
    ]


# ---------------------------------------------------------------------------------------------
# Tables: what `fastlm analyze memory` prints; strings are sentences in rich markup
# ---------------------------------------------------------------------------------------------


def _describe(step: TrainStep, name: str) -> str:
    config = step.config
    gpus = f"{step.gpus} GPU{'s' if step.gpus > 1 else ''}"
    mode = f"{step.parallel} on {gpus}" if PARALLEL[step.parallel].processes else "one process"
    batch = f"micro-batch {step.micro_batch} x {config.context_length}"
    if step.accumulation > 1:
        batch += f", {step.accumulation} per step"
    extras = ["recompute"] if config.recompute else []
    if step.sharded:
        extras.append(f"{step.bucket_mb:g} MB units")
    if step.reduce_dtype != "fp32":
        extras.append(f"gradients averaged in {step.reduce_dtype}")
    kernels = ", ".join(f"{name} {value}" for name, value in config.kernels.as_dict().items() if name != "softmax")
    return f"{name} · {config.num_parameters():,} parameters · {mode} · {batch} · " + ", ".join(
        [*extras, step.compile, "bf16", kernels]
    )


def memory_tables(step: TrainStep, name: str, contexts: Sequence[int] = ()) -> list[Table | str]:
    """The per-GPU breakdown, the predicted peak, communication per step, and with ``contexts``
    the predicted peak at each of those context lengths."""
    prediction = memory_terms(step)
    table = Table(title=f"Memory per GPU of fastlm train · {_describe(step, name)}")
    add_columns(table, ["term", "formula"], ["fwd -> bwd", "bwd end"])
    n_gib = lambda n_bytes: f"{n_bytes / 2**30:,.2f}" if n_bytes else ""
    for term in prediction.terms:
        table.add_row(term.what, term.formula, n_gib(term.forward_to_backward), n_gib(term.end_of_backward))
    fb, end = prediction.forward_to_backward, prediction.end_of_backward
    table.add_row("[bold]allocated[/] (max_memory_allocated)", "sum", n_gib(fb), n_gib(end))
    table.add_row(
        "CUDA context, NCCL (stated)", "outside the allocator", n_gib(CUDA_CONTEXT_BYTES), n_gib(CUDA_CONTEXT_BYTES)
    )
    p = step.config.num_parameters()
    state = step.mode.state_bytes_per_parameter(STATE, step.gpus) * p
    parts: list[Table | str] = [
        table,
        f"GiB · P = {p:,}, P_b = {step.config.num_block_parameters():,}, T = {step.tokens:,} tokens; "
        f"fp32 weights, gradients and AdamW moments: {STATE.total} x P{' / N' if step.shards > 1 else ''} = "
        f"{gib(state)}.",
        f"Predicted peak per GPU: [bold]{gib(prediction.peak)}[/] allocated ({prediction.moment}), "
        f"{gib(prediction.peak + CUDA_CONTEXT_BYTES)} with the CUDA context allowance. Assumptions: "
        "fastlm.analysis.train_memory.",
    ]
    transfers = communication(step)
    if transfers:
        parts.append(_communication_table(step, transfers))
    if contexts:
        parts.append(_contexts_table(step, name, contexts))
    return parts


def _communication_table(step: TrainStep, transfers: list[Transfer]) -> Table:
    table = Table(title=f"Communication per GPU and step · {step.parallel} on {step.gpus} GPUs · 1 GB = 1e9 B")
    add_columns(table, ["collective", "formula"], ["GB"])
    for transfer in transfers:
        table.add_row(transfer.what, transfer.formula, f"{transfer.bytes_per_step / 1e9:,.2f}")
    total = sum(t.bytes_per_step for t in transfers)
    table.add_row("[bold]total[/]", "", f"{total / 1e9:,.2f}")
    return table


def _contexts_table(step: TrainStep, name: str, contexts: Sequence[int]) -> Table:
    table = Table(title=f"Predicted peak per GPU by context · {name} · micro-batch {step.micro_batch}")
    add_columns(table, [], ["context", "tokens T", "peak", "at"])
    for context in contexts:
        at = dataclasses.replace(step, config=dataclasses.replace(step.config, context_length=context))
        prediction = memory_terms(at)
        table.add_row(f"{context:,}", f"{at.tokens:,}", gib(prediction.peak), prediction.moment)
    return table
