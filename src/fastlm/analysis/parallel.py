"""Napkin math for training a large stack of MLP blocks in parallel: memory, FSDP degree, compute-bound batch.

Notation follows "How to Scale Your Model" (Austin et al., jax-ml.github.io/scaling-book), part 5
"How to Parallelize a Transformer for Training": D = d_model, F = d_ff, B = batch in tokens,
C = FLOP/s per chip, W_ici = bidirectional ICI bandwidth (bytes/s), X and Y = chips on the FSDP and
tensor-parallel (TP) mesh axes, M_X and M_Y = how many mesh axes each of them spans, N = X * Y.

Assumptions, all of them:
- The model is ``blocks`` blocks of two bias-free linear layers, D -> F and F -> D. Attention,
  embeddings, the LM head, norms and activation functions are left out (they hold no parameters
  here and their saved tensors are not counted). Parameters P = 2 * blocks * D * F.
- Training state per parameter, all fp32: master weights 4 B, accumulated gradients 4 B, AdamW's two
  moments 8 B; 16 * P in all. No bf16 copy of the weights is kept between steps (the copies gathered
  for a matmul are transient and not counted), nor are optimizer temporaries, communication buffers,
  the CUDA/XLA context or allocator fragmentation.
- Saved activations: no activation checkpointing, and the backward pass needs the input of every
  linear layer: per block and token one D-vector (input of D -> F) and one F-vector (input of
  F -> D), in bf16 (2 B). Per token 2 * blocks * (D + F) bytes; A = tokens * that, with
  tokens = batch * context_length (default one sequence of 8192 tokens: these D, F and blocks are
  Llama 3.1 405B's, pre-trained at context 8192). Logits, the loss and the activation function's
  own saved tensor are left out.
- Units: 1 GB = 1e9 bytes (the 80 GB and 95 GB device sizes are decimal); GiB = 2**30 bytes.
- GPUs needed = ceil(bytes / per-GPU memory): a floor that assumes the bytes split perfectly.
- FSDP (ZeRO-3) over N devices: weights, gradients and AdamW state (16 * P) and half of the saved
  activations (A / 2, e.g. every second block's) are split evenly into N shards; the other half of
  the activations (A / 2) is replicated: every device holds all of it. Per device
      M(N) = (16 * P + A / 2) / N + A / 2,
  which falls with N towards A / 2. The smallest integer N with M(N) < limit is
  floor((16 * P + A / 2) / (limit - A / 2)) + 1, and none exists when A / 2 >= limit.
- Forward pass of mixed FSDP x TP, In[B_X, D_Y] *_D W_in[D_X, F_Y] *_F W_out[F_Y, D_X] -> Out[B_X, D_Y]
  (the book's "Mixed FSDP and Tensor Parallelism"), per block (layer pair), communication fully
  overlapped with math:
      T_math  = 2 matmuls * 2 FLOPs * B * D * F / (N * C)  = 4 * B * D * F / (N * C)
      T_FSDP  = 4 * D * F / (Y * W_ici * M_X)   AllGather over X of W_in and W_out, bf16: each device
                                                 ends with its F/Y slice of both, 2 * 2 * D * F / Y bytes
      T_TP    = 4 * B * D / (X * W_ici * M_Y)   AllGather of In[B_X, D_Y] and ReduceScatter of
                                                 Out[B_X, D], bf16: 2 * 2 * B * D / X bytes
  Like the book, a k-way collective costs bytes / (W_ici * axes), dropping its (k - 1) / k factor;
  so X = 1 or Y = 1 is still charged a collective it would not run (pessimistic by a few percent:
  with Y = 1 the true bound is the book's pure-FSDP B / N >= alpha / M_X). Latency is ignored.
  The run is compute-bound when T_math >= T_FSDP + T_TP. Every block has the same ratio, so
  ``blocks`` drops out. Dividing by 4 * D:
      B * (F / (N * C) - 1 / (X * W_ici * M_Y)) >= F / (Y * W_ici * M_X)
  If the bracket is <= 0 (F <= alpha * Y / M_Y with alpha = C / W_ici: the TP collectives alone
  take as long as the math, the book's TP limit Y < M_Y * F / alpha) no batch is compute-bound.
  Otherwise the smallest batch is
      B* = F / (Y * W_ici * M_X) / (F / (N * C) - 1 / (X * W_ici * M_Y))
         = alpha * F * X / (M_X * (F - alpha * Y / M_Y)),
  B* / N tokens per device. With X and Y fixed this is above the book's bound for the best split
  of N (B/N > 4 * alpha**2 / (F * M_X * M_Y)).
- The mesh defaults are TPU v5p's numbers in the book: W_ici = 2 * 9e10 B/s, C = 4.6e14 bf16
  FLOP/s, M_X = 2, M_Y = 1, X = 16 (FSDP), Y = 4 (TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.table import Table

from fastlm.analysis.tables import gib
from fastlm.settings import STATE_BYTES

GB = 10**9  # bytes; device sizes (80 GB, 95 GB) are decimal
# per parameter: fp32 master weights and accumulated gradients, AdamW's two fp32 moments (bf16 compute)
STATE = STATE_BYTES["bf16"]
ACTIVATION_BYTES = 2  # bf16, per saved element
COMMS_BYTES = 2  # bf16: gathered weights and exchanged activations on the wire


def _check_positive_ints(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_positive_numbers(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """The model (blocks of D -> F -> D linear layers) and the tokens whose activations are saved."""

    d_model: int = 16384
    d_ff: int = 53248
    blocks: int = 126
    batch: int = 1  # sequences
    context_length: int = 8192  # tokens per sequence

    def __post_init__(self) -> None:
        _check_positive_ints(
            d_model=self.d_model,
            d_ff=self.d_ff,
            blocks=self.blocks,
            batch=self.batch,
            context_length=self.context_length,
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.context_length


@dataclass(frozen=True)
class MeshConfig:
    """A 2D FSDP (x) x TP (y) mesh of chips; defaults are TPU v5p's in the scaling book."""

    w_ici: float = 2 * 9e10  # bidirectional ICI bandwidth per chip and axis, bytes/s
    flops: float = 4.6e14  # C: bf16 FLOP/s per chip
    m_x: int = 2  # mesh axes the FSDP dimension spans
    m_y: int = 1  # mesh axes the TP dimension spans
    x: int = 16  # FSDP degree
    y: int = 4  # TP degree

    def __post_init__(self) -> None:
        _check_positive_numbers(w_ici=self.w_ici, flops=self.flops)
        _check_positive_ints(m_x=self.m_x, m_y=self.m_y, x=self.x, y=self.y)

    @property
    def devices(self) -> int:
        """N = X * Y."""
        return self.x * self.y

    @property
    def ici_intensity(self) -> float:
        """alpha = C / W_ici, FLOPs per byte sent over one ICI axis."""
        return self.flops / self.w_ici


@dataclass(frozen=True)
class MemoryAccounting:
    """Bytes of one unsharded training replica."""

    parameters: int  # P, a count
    master_weights: int
    gradients: int
    adamw_state: int
    activations_per_token: int
    activations: int  # A

    @property
    def state(self) -> int:
        """Master weights + gradients + AdamW state: 16 * P, what FSDP shards."""
        return self.master_weights + self.gradients + self.adamw_state

    @property
    def total(self) -> int:
        return self.state + self.activations


@dataclass(frozen=True)
class ForwardTimes:
    """Seconds per block of the forward pass on the mesh, at one batch size."""

    math_s: float
    fsdp_comms_s: float
    tp_comms_s: float

    @property
    def comms_s(self) -> float:
        return self.fsdp_comms_s + self.tp_comms_s

    @property
    def compute_bound(self) -> bool:
        return self.math_s >= self.comms_s


def parameter_count(config: ParallelConfig) -> int:
    """P = 2 * blocks * d_model * d_ff (two bias-free linear layers per block)."""
    return 2 * config.blocks * config.d_model * config.d_ff


def activation_bytes_per_token(config: ParallelConfig) -> int:
    """Inputs of both linear layers of every block, bf16: 2 * blocks * (d_model + d_ff)."""
    return ACTIVATION_BYTES * config.blocks * (config.d_model + config.d_ff)


def memory_accounting(config: ParallelConfig) -> MemoryAccounting:
    """fp32 master weights, gradients and AdamW state, and the bf16 activations saved for backward."""
    p = parameter_count(config)
    per_token = activation_bytes_per_token(config)
    return MemoryAccounting(
        parameters=p,
        master_weights=STATE.weights * p,
        gradients=STATE.gradients * p,
        adamw_state=STATE.optimizer * p,
        activations_per_token=per_token,
        activations=config.tokens * per_token,
    )


def devices_needed(total_bytes: int, device_memory_gb: float) -> int:
    """ceil(total_bytes / device memory): how many devices of ``device_memory_gb`` GB hold the bytes."""
    _check_positive_ints(total_bytes=total_bytes)
    _check_positive_numbers(device_memory_gb=device_memory_gb)
    return math.ceil(total_bytes / (device_memory_gb * GB))


def fsdp_memory_per_device(config: ParallelConfig, n_fsdp: int) -> float:
    """Bytes per device, (16 * P + A / 2) / n_fsdp + A / 2: state and half the activations sharded."""
    _check_positive_ints(n_fsdp=n_fsdp)
    memory = memory_accounting(config)
    half_activations = memory.activations / 2
    return (memory.state + half_activations) / n_fsdp + half_activations


def smallest_fsdp_degree(config: ParallelConfig, device_memory_gb: float) -> int | None:
    """The smallest N with fsdp_memory_per_device(config, N) < device_memory_gb GB; None if no N is.

    None when the replicated half of the activations alone, A / 2, is at least the device memory.
    """
    _check_positive_numbers(device_memory_gb=device_memory_gb)
    limit = device_memory_gb * GB
    memory = memory_accounting(config)
    half_activations = memory.activations / 2
    if half_activations >= limit:
        return None
    n = math.floor((memory.state + half_activations) / (limit - half_activations)) + 1
    # the closed form in floating point can be one off at a boundary; settle it on the function itself
    while n > 1 and fsdp_memory_per_device(config, n - 1) < limit:
        n -= 1
    while fsdp_memory_per_device(config, n) >= limit:
        n += 1
    return n


def forward_times(config: ParallelConfig, mesh: MeshConfig, batch_tokens: float) -> ForwardTimes:
    """T_math, T_FSDP and T_TP of one block's forward pass for a total batch of ``batch_tokens`` tokens."""
    _check_positive_numbers(batch_tokens=batch_tokens)
    d, f, w = config.d_model, config.d_ff, mesh.w_ici
    return ForwardTimes(
        math_s=2 * 2 * batch_tokens * d * f / (mesh.devices * mesh.flops),  # 2 matmuls, 2 FLOPs per multiply-add
        fsdp_comms_s=2 * COMMS_BYTES * d * f / (mesh.y * w * mesh.m_x),  # gather W_in[D, F_Y] and W_out[F_Y, D]
        tp_comms_s=2 * COMMS_BYTES * batch_tokens * d / (mesh.x * w * mesh.m_y),  # gather In, scatter Out[B_X, D]
    )


def compute_bound_batch(config: ParallelConfig, mesh: MeshConfig) -> float | None:
    """Smallest total batch B (tokens) with T_math >= T_FSDP + T_TP; None if no batch is compute-bound.

    B / mesh.devices is the per-device batch. The threshold is a real number: whole batches at or
    above it are compute-bound.
    """
    # the three times divided by 4 * D: math and TP grow with B, FSDP does not
    math_per_token = config.d_ff / (mesh.devices * mesh.flops)
    tp_per_token = 1 / (mesh.x * mesh.w_ici * mesh.m_y)
    fsdp = config.d_ff / (mesh.y * mesh.w_ici * mesh.m_x)
    if math_per_token <= tp_per_token:
        return None
    return fsdp / (math_per_token - tp_per_token)


# ---------------------------------------------------------------------------------------------
# Tables: what `fastlm analyze parallel` prints; strings are sentences in rich markup
# ---------------------------------------------------------------------------------------------


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / GB:,.2f} GB"


def cost_tables(
    config: ParallelConfig, mesh: MeshConfig, gpu_memory_gb: float, device_memory_gb: float
) -> list[Table | str]:
    """Memory and the count of ``gpu_memory_gb`` GB GPUs that hold it; the FSDP degree under
    ``device_memory_gb`` GB per device; the compute-bound batch of the forward pass on ``mesh``."""
    return [
        *_memory_tables(config, gpu_memory_gb),
        *_fsdp_tables(config, device_memory_gb),
        *_forward_tables(config, mesh),
    ]


def _memory_tables(config: ParallelConfig, gpu_memory_gb: float) -> list[Table | str]:
    memory = memory_accounting(config)
    table = Table(
        title=f"Training memory · d_model {config.d_model}, d_ff {config.d_ff}, {config.blocks} blocks of "
        f"two linear layers · {config.tokens:,} tokens (batch {config.batch} x context "
        f"{config.context_length}) · 1 GB = 1e9 bytes, 1 GiB = 2^30"
    )
    table.add_column("what")
    table.add_column("formula")
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_row("parameters P", "2 x blocks x d_model x d_ff", f"{memory.parameters:,}", "")
    for what, formula, n_bytes in (
        ("master weights (fp32)", "4 x P", memory.master_weights),
        ("accumulated gradients (fp32)", "4 x P", memory.gradients),
        ("AdamW state (fp32 m and v)", "8 x P", memory.adamw_state),
        ("weights + gradients + AdamW", "16 x P", memory.state),
    ):
        table.add_row(what, formula, _gb(n_bytes), gib(n_bytes))
    table.add_row(
        "saved activations per token (bf16)", "2 x blocks x (d_model + d_ff)", f"{memory.activations_per_token:,} B", ""
    )
    table.add_row(
        f"saved activations A, {config.tokens:,} tokens",
        "tokens x per token",
        _gb(memory.activations),
        gib(memory.activations),
    )
    table.add_row("total", "16 x P + A", _gb(memory.total), gib(memory.total))
    gpu = f"{gpu_memory_gb:g} GB"
    gpus = [devices_needed(n_bytes, gpu_memory_gb) for n_bytes in (memory.state, memory.total)]
    table.add_row(f"{gpu} GPUs for 16 x P", f"ceil(16 x P / {gpu})", str(gpus[0]), "")
    table.add_row(f"{gpu} GPUs for 16 x P + A", f"ceil((16 x P + A) / {gpu})", str(gpus[1]), "")
    return [
        table,
        f"{gpu} GPUs to hold it: [bold]{gpus[0]}[/] for weights, gradients and AdamW state, "
        f"[bold]{gpus[1]}[/] with the saved activations too.",
    ]


def _fsdp_tables(config: ParallelConfig, limit_gb: float) -> list[Table | str]:
    n_min = smallest_fsdp_degree(config, limit_gb)
    half = memory_accounting(config).activations / 2
    table = Table(
        title=f"FSDP over N devices: 16 x P and A/2 sharded, the other A/2 on every device · "
        f"per device (16 x P + A/2) / N + A/2 · limit {limit_gb:g} GB"
    )
    table.add_column("N", justify="right", no_wrap=True)
    table.add_column("(16 x P + A/2) / N", justify="right", no_wrap=True)
    table.add_column("A/2", justify="right", no_wrap=True)
    table.add_column("per device", justify="right", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column(f"< {limit_gb:g} GB", no_wrap=True)
    shown = sorted({1, 8, 64} | ({n_min - 1, n_min} - {0} if n_min else set()))
    for n in shown:
        per_device = fsdp_memory_per_device(config, n)
        table.add_row(
            str(n),
            _gb(per_device - half),
            _gb(half),
            _gb(per_device),
            gib(per_device),
            "yes" if per_device < limit_gb * GB else "no",
        )
    if n_min is None:
        return [
            table,
            f"No N_FSDP fits under {limit_gb:g} GB: the replicated half of the activations alone, "
            f"A/2 = {_gb(half)}, does not; save fewer tokens (--batch, --context).",
        ]
    per_device = fsdp_memory_per_device(config, n_min)
    return [
        table,
        f"Smallest N_FSDP with per-device memory under {limit_gb:g} GB: [bold]{n_min}[/] "
        f"({_gb(per_device)} = {gib(per_device)} per device).",
    ]


def _forward_tables(config: ParallelConfig, mesh: MeshConfig) -> list[Table | str]:
    batch = compute_bound_batch(config, mesh)
    n_devices = mesh.devices
    title = (
        f"Forward pass, FSDP x TP · X = {mesh.x} (FSDP, M_X = {mesh.m_x}) x Y = {mesh.y} (TP, M_Y = {mesh.m_y}) "
        f"= {n_devices} chips · C = {mesh.flops:.3g} FLOP/s, W_ici = {mesh.w_ici:.3g} B/s"
    )
    if batch is None:
        alpha = mesh.ici_intensity
        return [
            f"[bold]{title}[/]",
            f"No batch is compute-bound: the TP collectives alone take as long as the math, since d_ff = "
            f"{config.d_ff} <= alpha x Y / M_Y = {alpha * mesh.y / mesh.m_y:,.1f} "
            f"(alpha = C / W_ici = {alpha:,.1f}); use a smaller --y or a larger --my.",
        ]
    times = forward_times(config, mesh, batch)
    per_device = math.ceil(batch / n_devices)
    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("formula")
    table.add_column("value", justify="right", no_wrap=True)
    us = lambda seconds: f"{seconds * 1e6:,.1f} µs"
    table.add_row("alpha, ICI FLOPs per byte", "C / W_ici", f"{mesh.ici_intensity:,.1f} FLOP/B")
    table.add_row("smallest compute-bound batch B", "alpha F X / (M_X (F - alpha Y / M_Y))", f"{batch:,.1f} tokens")
    table.add_row("per-device batch", "B / N", f"{batch / n_devices:,.1f} tokens")
    table.add_row(
        "smallest whole per-device batch",
        "ceil(B / N), total x N",
        f"{per_device:,} ({per_device * n_devices:,} in all)",
    )
    table.add_row("T_math per block at B", "4 B D F / (N C)", us(times.math_s))
    table.add_row("T_FSDP: AllGather weights on X", "4 D F / (Y W_ici M_X)", us(times.fsdp_comms_s))
    table.add_row("T_TP: In and Out collectives on Y", "4 B D / (X W_ici M_Y)", us(times.tp_comms_s))
    return [
        table,
        "Compute-bound when T_math >= T_FSDP + T_TP (communication overlapped with math; How to Scale "
        "Your Model, 'Mixed FSDP and Tensor Parallelism'); the times are per block and the same ratio "
        "holds for all blocks. Assumptions: fastlm.analysis.parallel, docs/distributed.md.",
    ]
