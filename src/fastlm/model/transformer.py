"""The fastlm language model: a pre-norm decoder-only Transformer in one file.

    tokens (B, N) -> embedding (B, N, d)
      -> num_layers x [ x + attention(rms_norm(x)),  x + swiglu(rms_norm(x)) ]
      -> rms_norm -> LM head (B, N, V)              (with targets: -> the mean next-token loss)

A mixture of experts (``ModelConfig.num_experts`` > 0) has `fastlm.layers.moe.MoEMLP` in place of
the SwiGLU in its MoE blocks (``moe_layers``); while gradients are on (training), the loss adds
router_aux_coef x the mean load-balancing loss of those blocks (and router_z_coef x their mean
z-loss), and `RouterStatistics` totals the routers' statistics for the training log.

Attention is causal multi-head self-attention with separate q/k/v/output projections and RoPE on
q and k; the feed-forward is SwiGLU, w2(silu(w1 x) * w3 x); no biases anywhere; the LM head is not
tied to the embedding. The blocks are `fastlm.layers`; ``ModelConfig.kernels`` (a
`fastlm.settings.Kernels`) picks each layer's kernel: attention, norm, rope, mlp, loss, softmax.

Packed rows: ``cu_seqlens`` (int32 cumulative document lengths over the B N tokens laid end to end,
every row starting a document, as `fastlm.data.documents.cu_seqlens` makes them from prepared data)
keeps attention inside each document: fastlm runs `fastlm.flash_attention_varlen` on the packed
tokens, naive and sdpa a (B, 1, N, N) mask. ``ModelConfig.window`` gives the blocks a sliding
window (``global_every`` keeps every k-th one global); fastlm skips the tiles outside it.
``ModelConfig.recompute`` keeps only each block's input for backward, which runs the block's
forward again (activation checkpointing).

`TransformerLM.hidden_states` is the model up to the LM head (what `fastlm.sequence_logprobs` and
`fastlm.linear_dpo_loss` take); `RewardModel` puts a scalar head there instead of the LM head.

A range named "forward" around the model (and the naive attention's own) shows up in profiles when
`fastlm.layers.ranges.annotations()` is on.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastlm.layers.attention import Attention, attention_mask, document_segments
from fastlm.layers.linear import Embedding, Linear
from fastlm.layers.loss import lm_head_loss
from fastlm.layers.mlp import SwiGLUMLP
from fastlm.layers.moe import MoEMLP, RouterStatistics
from fastlm.layers.norms import RMSNorm
from fastlm.layers.ranges import annotate
from fastlm.layers.rotary import RotaryEmbedding
from fastlm.model.config import ModelConfig


class Block(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int = 0) -> None:
        super().__init__()
        kernels = config.kernels
        self.attention_norm = RMSNorm(config.d_model, eps=config.norm_eps, kernel=kernels.norm)
        self.attention = Attention(
            config.d_model,
            config.num_heads,
            rope,
            window=config.layer_window(layer),
            kernel=kernels.attention,
            softmax=kernels.softmax,
        )
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps, kernel=kernels.norm)
        if config.is_moe_layer(layer):
            self.ffn = MoEMLP(
                config.d_model,
                config.num_experts,
                config.experts_per_token,
                config.expert_width,
                config.shared_experts,
                kernel=kernels.mlp,
            )
        else:
            self.ffn = SwiGLUMLP(config.d_model, config.d_ff, kernel=kernels.mlp)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, masks: dict | None = None
    ) -> tuple[torch.Tensor, RouterStatistics | None]:
        """(the block's output, its router's statistics or None for a dense block); masks:
        `TransformerLM.attention_masks`'s, keyed by window."""
        allowed = None if masks is None else masks[self.attention.window]
        x = x + self.attention(self.attention_norm(x), cu_seqlens, allowed)
        if isinstance(self.ffn, MoEMLP):
            out, statistics = self.ffn(self.ffn_norm(x))
            return x + out, statistics
        return x + self.ffn(self.ffn_norm(x)), None


class BlockStack(nn.Module):
    """The blocks, run in order: a module with a forward of its own (FSDP2's `fully_shard` refuses a
    ModuleList, which has none) so that fsdp can shard all of them as one unit and compile them as one graph;
    its children are named "0", "1", ... as a ModuleList's, so state-dict keys stay blocks.<i>.*."""

    def __init__(self, blocks) -> None:
        super().__init__()
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> Block:
        return list(self._modules.values())[index]

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, masks: dict | None, recompute: bool
    ) -> tuple[torch.Tensor, list[RouterStatistics]]:
        """(the last block's output, the MoE blocks' router statistics in order); recompute: keep
        only each block's input for backward, which runs the block again (the statistics are the
        first forward's)."""
        routers = []
        for block in self:
            x, statistics = (
                checkpoint(block, x, cu_seqlens, masks, use_reentrant=False)
                if recompute
                else block(x, cu_seqlens, masks)
            )
            if statistics is not None:
                routers.append(statistics)
        return x, routers


class RouterTotals(nn.Module):
    """The routers' statistics summed over the training forwards since the last `take`, on the
    model's device (no host wait): per MoE block the load-balancing loss and the choices per expert,
    what the routers added to the loss, and the number of forwards. Buffers, not state-dict
    entries: a checkpoint does not keep them."""

    def __init__(self, moe_layers: int, experts: int) -> None:
        super().__init__()
        self.register_buffer("balance", torch.zeros(moe_layers), persistent=False)
        self.register_buffer("counts", torch.zeros(moe_layers, experts, dtype=torch.int64), persistent=False)
        self.register_buffer("added", torch.zeros(()), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64), persistent=False)

    def reset_parameters(self) -> None:
        for buffer in self.buffers():
            buffer.zero_()

    @torch.no_grad()
    def add(self, routers: list[RouterStatistics], added: torch.Tensor) -> None:
        self.balance += torch.stack([r.balance for r in routers])
        self.counts += torch.stack([r.counts for r in routers])
        self.added += added
        self.forwards += 1

    def take(self) -> torch.Tensor:
        """The totals as one flat fp32 tensor (what `fields` reads; sums over ranks add up), which
        restart at zero."""
        totals = torch.cat([buffer.float().reshape(-1) for buffer in self.buffers()])
        self.reset_parameters()
        return totals

    def fields(self, totals: list[float]) -> dict:
        """The log's fields from `take`'s totals (their means over ranks are as good):
        router_loss, what the routers added to the loss per forward; aux_loss, the MoE blocks'
        mean load-balancing loss (experts_per_token when balanced); expert_load, per MoE block
        the busiest expert's choices over the mean (1 when balanced)."""
        layers, experts = self.counts.shape
        balance, counts = totals[:layers], totals[layers : layers * (experts + 1)]
        added, forwards = totals[-2], totals[-1]
        loads = [counts[i * experts : (i + 1) * experts] for i in range(layers)]
        return {
            "router_loss": added / forwards,
            "aux_loss": sum(balance) / layers / forwards,
            "expert_load": [max(load) * experts / sum(load) if sum(load) else None for load in loads],
        }


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.d_model)
        rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, config.kernels.rope)
        self.blocks = BlockStack(Block(config, rope, layer) for layer in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, kernel=config.kernels.norm)
        self.lm_head = Linear(config.d_model, config.vocab_size)
        moe_layers = len(config.moe_layers)
        self.router_totals = RouterTotals(moe_layers, config.num_experts) if moe_layers else None

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (B, N) int -> logits (B, N, V); with targets (B, N), the mean next-token loss;
        cu_seqlens as `hidden_states` takes it."""
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal tokens shape {tuple(tokens.shape)}")
        with annotate("forward"):
            x, routers = self._hidden_states(tokens, cu_seqlens)  # (B, N, d)
            if targets is None:
                return self.lm_head(x)  # (B, N, V)
            loss = lm_head_loss(x, self.lm_head, targets, kernel=self.config.kernels.loss)
            return loss + self.router_loss(routers) if routers and torch.is_grad_enabled() else loss

    def router_loss(self, routers: list[RouterStatistics]) -> torch.Tensor:
        """What training adds to the loss for the MoE blocks' ``routers``: router_aux_coef x their
        mean load-balancing loss + router_z_coef x their mean z-loss; their statistics are added to
        `router_totals` on the way."""
        config = self.config
        loss = config.router_aux_coef * torch.stack([r.balance for r in routers]).mean()
        if config.router_z_coef:
            loss = loss + config.router_z_coef * torch.stack([r.z for r in routers]).mean()
        self.router_totals.add(routers, loss)
        return loss

    def hidden_states(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, N) int -> the final norm's output (B, N, d), what the LM head reads (a
        mixture of experts' routers add nothing to any loss through it).

        cu_seqlens: None (each row one sequence), or int32 (S + 1,) on tokens' device, the
        cumulative lengths of the documents of the B N tokens laid end to end: rising from 0 to
        B N, with every row start among them (no document spans rows); trailing repeats of B N
        (empty documents) are allowed. Not checked on the GPU (that would wait for it)."""
        return self._hidden_states(tokens, cu_seqlens)[0]

    def _hidden_states(
        self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[RouterStatistics]]:
        """`hidden_states` and the MoE blocks' router statistics (`BlockStack.forward`)."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            shape = tuple(tokens.shape)
            raise ValueError(f"tokens must be a (batch, length) integer tensor, got {shape} {tokens.dtype}")
        if tokens.shape[1] > self.config.context_length:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds context_length {self.config.context_length}")
        # ids outside the vocabulary: checked where it costs no host synchronization (a CUDA device
        # asserts in the embedding instead; the training loop checks every batch before the copy)
        if tokens.device.type != "cuda" and not torch.compiler.is_compiling() and tokens.numel():
            low, high = tokens.min().item(), tokens.max().item()
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"tokens must be ids in [0, {self.config.vocab_size}) (vocab_size), got {bad}")
        if cu_seqlens is not None:
            _check_cu_seqlens(cu_seqlens, tokens)
        x = self.embedding(tokens)
        masks = self.attention_masks(cu_seqlens, *tokens.shape, tokens.device)
        x, routers = self.blocks(x, cu_seqlens, masks, self.config.recompute and torch.is_grad_enabled())
        return self.final_norm(x), routers

    def attention_masks(self, cu_seqlens, batch: int, length: int, device) -> dict | None:
        """naive and sdpa: the `attention_mask` of each window the blocks use ({window: mask, or None
        where plain causal attention does}), built once per forward, so every layer shares one
        tensor (SDPA keeps its mask for backward); None for fastlm, which takes cu_seqlens and
        skips tiles itself, and where nothing narrows causal attention."""
        if self.config.kernels.attention == "fastlm" or (cu_seqlens is None and self.config.window is None):
            return None
        segments = None if cu_seqlens is None else document_segments(cu_seqlens, batch, length)
        windows = {block.attention.window for block in self.blocks}
        return {
            w: None if w is None and segments is None else attention_mask(segments, length, w, device) for w in windows
        }


def _check_cu_seqlens(cu_seqlens: torch.Tensor, tokens: torch.Tensor) -> None:
    """Type, shape and device always; the values off the GPU (where reading them costs no wait)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"cu_seqlens must be a torch.Tensor on tokens' device, got {type(cu_seqlens).__name__} "
            "(from numpy: torch.from_numpy(cu_seqlens).to(tokens.device))"
        )
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(
            f"cu_seqlens must be int32 (documents + 1,) cumulative lengths, got {tuple(cu_seqlens.shape)} "
            f"{str(cu_seqlens.dtype).removeprefix('torch.')}"
        )
    if cu_seqlens.device != tokens.device:
        raise ValueError(f"cu_seqlens must be on tokens' device {tokens.device}, got {cu_seqlens.device}")
    if tokens.device.type == "cuda" or torch.compiler.is_compiling():
        return
    batch, length = tokens.shape
    bounds = cu_seqlens.tolist()
    rows = set(range(0, batch * length, length))
    if bounds[0] != 0 or bounds[-1] != batch * length or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must rise from 0 to {batch * length} (batch x length) without falling")
    if not rows <= set(bounds):
        raise ValueError(f"cu_seqlens must start a document at every row start (multiples of {length})")


class RewardModel(TransformerLM):
    """The LM with a scalar head in place of the LM head (a reward model, as in InstructGPT):

        tokens (B, N), lengths (B,) -> hidden states (B, N, d) -> h = the state of token lengths - 1
        -> reward = w . h (B,)

    Sequences are padded on the right, so by causality the last real token's state never sees the
    padding. No bias: the preference losses depend only on differences of rewards. The state dict is
    the LM's without lm_head, so an LM's weights load into it with ``strict=False``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.lm_head = None
        self.reward_head = Linear(config.d_model, 1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) int, lengths (B,) int in [1, N] -> rewards (B,) in fp32."""
        if lengths.shape != tokens.shape[:1]:
            raise ValueError(
                f"lengths must have shape ({tokens.shape[0]},) to match tokens {tuple(tokens.shape)}, "
                f"got {tuple(lengths.shape)}"
            )
        if lengths.device.type != "cuda" and not torch.compiler.is_compiling() and lengths.numel():
            if lengths.min().item() < 1 or lengths.max().item() > tokens.shape[1]:
                raise ValueError(f"lengths must be in [1, {tokens.shape[1]}] (the padded length)")
        with annotate("forward"):
            x = self.hidden_states(tokens)  # (B, N, d)
            last = x[torch.arange(x.shape[0], device=x.device), lengths - 1]  # (B, d)
            return self.reward_head(last).squeeze(-1).float()
