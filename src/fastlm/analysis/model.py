"""Napkin math for the language model: FLOPs per token, MFU, and memory accounting.

FLOPs convention (a multiply-add is 2 FLOPs):
- matrix multiplies with weights: 2*N per token forward and 4*N backward (input and weight
  gradients), so 6*N per trained token, where N = `ModelConfig.num_matmul_parameters()` (every
  projection and the LM head; the embedding is a lookup and does no FLOPs);
- attention scores q k^T and the weighted sum P v: per layer and token, 2*T*d each for a full T x T
  score matrix; the causal mask halves the useful work, and we count only that half: 2*T*d forward
  and 6*T*d forward+backward per layer (PaLM's appendix counts the full matrix, 12*T*d, which would
  flatter the MFU by a few percent at T=512).
MFU = achieved FLOP/s / the device's dense bf16 tensor-core peak from `fastlm.devices` (also for
fp32 runs, so their rows show what the lower precision buys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from fastlm.devices import DeviceSpec
from fastlm.model.config import ModelConfig

MODES = ("fwd", "fwd+bwd", "train")  # forward only | forward and backward | backward + AdamW step


def flops_per_token(config: ModelConfig, mode: str, seq_len: int | None = None) -> float:
    """Model FLOPs per token for ``mode`` at sequence length ``seq_len`` (default: the context)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    t = config.context_length if seq_len is None else seq_len
    forward = 2 * config.num_matmul_parameters() + 2 * config.num_layers * t * config.d_model
    return forward if mode == "fwd" else 3 * forward


def mfu(config: ModelConfig, mode: str, tokens_per_s: float, spec: DeviceSpec, seq_len: int | None = None) -> float:
    """Model FLOPs utilization: flops_per_token * tokens/s over the device's bf16 peak."""
    return flops_per_token(config, mode, seq_len) * tokens_per_s / (spec.matmul_tflops * 1e12)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes held by a training run of ``config`` with fp32 parameters and AdamW (two fp32 moments)."""

    config: ModelConfig
    batch: int
    seq_len: int

    @property
    def parameters(self) -> int:
        return 4 * self.config.num_parameters()

    @property
    def gradients(self) -> int:
        return 4 * self.config.num_parameters()

    @property
    def adamw_state(self) -> int:
        return 2 * 4 * self.config.num_parameters()

    def residual_activation(self, bytes_per_element: int) -> int:
        """One (batch, seq_len, d_model) tensor of the residual stream."""
        return self.batch * self.seq_len * self.config.d_model * bytes_per_element

    @property
    def static(self) -> int:
        """Everything that lives for the whole run: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.adamw_state


def memory_table(config: ModelConfig, name: str, batch: int, contexts: Sequence[int]) -> Table:
    """What `fastlm analyze memory` prints: the training state of ``config`` (called ``name``) and one
    residual-stream activation per context length."""
    gib = lambda n: f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
    memory = TrainingMemory(config, batch, max(contexts))
    table = Table(title=f"Training memory · {name} · {config.num_parameters():,} parameters · batch {batch}")
    table.add_column("what")
    table.add_column("formula")
    table.add_column("bytes", justify="right")
    table.add_row("parameters (fp32)", "4 x N", gib(memory.parameters))
    table.add_row("gradients (fp32)", "4 x N", gib(memory.gradients))
    table.add_row("AdamW state (fp32 m and v)", "8 x N", gib(memory.adamw_state))
    table.add_row("total before activations", "16 x N", gib(memory.static))
    for context in contexts:
        one = TrainingMemory(config, batch, context)
        table.add_row(
            f"one residual-stream activation, context {context}",
            "batch x context x d_model x bytes",
            f"{gib(one.residual_activation(4))} fp32 / {gib(one.residual_activation(2))} bf16",
        )
    return table
