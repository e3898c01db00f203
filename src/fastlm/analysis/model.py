"""Napkin math for the language model: FLOPs per token and MFU (memory: `fastlm.analysis.train_memory`).

FLOPs convention (a multiply-add is 2 FLOPs):
- matrix multiplies with weights: 2*N per token forward and 4*N backward (input and weight
  gradients), so 6*N per trained token, where N = `ModelConfig.num_matmul_parameters(active=True)`
  (every projection and the LM head; of a mixture of experts the router, the K experts a token
  goes to and the shared ones; the embedding is a lookup and does no FLOPs);
- attention scores q k^T and the weighted sum P v: per layer and token, 2*T*d each for a full T x T
  score matrix; the causal mask halves the useful work, and we count only that half: 2*T*d forward
  and 6*T*d forward+backward per layer (PaLM's appendix counts the full matrix, 12*T*d, which would
  flatter the MFU by a few percent at T=512).
MFU = achieved FLOP/s / the device's dense bf16 tensor-core peak from `fastlm.devices` (also for
fp32 runs, so their rows show what the lower precision buys).
"""

from __future__ import annotations

from fastlm.devices import DeviceSpec
from fastlm.model.config import ModelConfig

MODES = ("fwd", "fwd+bwd", "train")  # forward only | forward and backward | backward + AdamW step


def flops_per_token(config: ModelConfig, mode: str, seq_len: int | None = None) -> float:
    """Model FLOPs per token for ``mode`` at sequence length ``seq_len`` (default: the context)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    t = config.context_length if seq_len is None else seq_len
    forward = 2 * config.num_matmul_parameters(active=True) + 2 * config.num_layers * t * config.d_model
    return forward if mode == "fwd" else 3 * forward


def mfu(config: ModelConfig, mode: str, tokens_per_s: float, spec: DeviceSpec, seq_len: int | None = None) -> float:
    """Model FLOPs utilization: flops_per_token * tokens/s over the device's bf16 peak."""
    return flops_per_token(config, mode, seq_len) * tokens_per_s / (spec.matmul_tflops * 1e12)
