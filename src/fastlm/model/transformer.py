"""The fastlm language model: a pre-norm decoder-only Transformer in one file.

    tokens (B, N) -> embedding (B, N, d)
      -> num_layers x [ x + attention(rms_norm(x)),  x + swiglu(rms_norm(x)) ]
      -> rms_norm -> LM head (B, N, V)              (with targets: -> the mean next-token loss)

Attention is causal multi-head self-attention with separate q/k/v/output projections and RoPE on
q and k; the feed-forward is SwiGLU, w2(silu(w1 x) * w3 x); no biases anywhere; the LM head is not
tied to the embedding. Switches in `ModelConfig` pick the kernels:

    attention  naive  | sdpa  | fastlm   (materialized softmax | torch SDPA | fastlm.flash_attention)
    norm       torch  | fastlm | auto    (fp32 PyTorch ops | fastlm.rms_norm | fastlm.rms_norm in eager
                                          mode, PyTorch ops under torch.compile)
    rope       torch  | fastlm | auto    (PyTorch ops | fastlm.rotary_embedding | that in eager mode,
                                          PyTorch ops under torch.compile)
    loss       torch  | fastlm           (LM head + F.cross_entropy | fastlm.linear_cross_entropy,
                                          which never materializes the (B*N, V) logits)
    softmax    torch  | fastlm           (naive attention's mask + softmax | fastlm.masked_softmax)

Packed rows: ``cu_seqlens`` (int32 cumulative document lengths over the B N tokens laid end to end,
every row starting a document, as `fastlm.data.documents.cu_seqlens` makes them from prepared data)
keeps attention inside each document: fastlm runs `fastlm.flash_attention_varlen` on the packed
tokens, naive and sdpa a (B, 1, N, N) mask. ``ModelConfig.window`` gives the blocks a sliding
window (``global_every`` keeps every k-th one global); fastlm skips the tiles outside it.
``ModelConfig.recompute`` keeps only each block's input for backward, which runs the block's
forward again (activation checkpointing).

`TransformerLM.hidden_states` is the model up to the LM head (what `fastlm.sequence_logprobs` and
`fastlm.linear_dpo_loss` take); `RewardModel` puts a scalar head there instead of the LM head.

Ranges named "attention/scores|mask|softmax|output" inside the naive path, and "forward" around
the model, show up in profiles when `fastlm.model.ranges.annotations()` is on.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastlm.model.config import ModelConfig
from fastlm.model.ranges import annotate
from fastlm.ops.flash_attention import flash_attention, flash_attention_varlen
from fastlm.ops.layer_norm import rms_norm
from fastlm.ops.linear_cross_entropy import linear_cross_entropy
from fastlm.ops.masked_softmax import masked_softmax
from fastlm.ops.rotary import DTYPES as ROTARY_DTYPES
from fastlm.ops.rotary import rotary_embedding, rotate_half


def trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std) clipped at 3 standard deviations, in place."""
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T without bias; W (d_out, d_in) ~ truncated normal, std sqrt(2 / (d_in + d_out))."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d_out, d_in = self.weight.shape
        trunc_normal_(self.weight, math.sqrt(2.0 / (d_in + d_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[1]}, d_out={self.weight.shape[0]}"


def linear_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights of the linear layers inside ``module`` (this file's `Linear` and
    `torch.nn.Linear`): the matmul weights that a ``param_dtype`` group of `fastlm.optim.AdamW`
    can store in bf16 (docs/optim.md)."""
    return [m.weight for m in module.modules() if isinstance(m, (Linear, nn.Linear))]


class Embedding(nn.Module):
    """Token ids (B, N) -> vectors (B, N, d); table (V, d) ~ truncated normal with std 1."""

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        trunc_normal_(self.weight, 1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # F.embedding, not weight[tokens]: its backward is the dedicated embedding kernel, not a
        # general index_put with accumulation
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32, returned in x's dtype;
    ``kernel`` "fastlm" runs the fused kernel (`fastlm.rms_norm`), "torch" plain PyTorch ops,
    "auto" the fused kernel in eager mode and PyTorch ops while torch.compile traces: Inductor
    fuses those into the kernels of the residual add before and the cast after, where a separate
    norm kernel reads and writes the activations once more (measured: docs/notes/host_path.md).

    Under autocast the fused kernel writes the autocast dtype instead: every norm here feeds a
    Linear, which would cast to that dtype anyway, so the values are the same and an fp32 write
    plus a cast pass are saved (torch.compile fuses the same cast into its own norm kernel)."""

    def __init__(self, d_model: int, eps: float, kernel: str = "torch") -> None:
        super().__init__()
        self.eps, self.kernel = eps, kernel
        self.weight = nn.Parameter(torch.ones(d_model))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fastlm" or (self.kernel == "auto" and not torch.compiler.is_compiling()):
            device = x.device.type
            out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each pair (x_i, x_{i+Dh/2}) of a head vector at position p by p * theta^(-2i/Dh).

    This is the "rotate half" pairing (GPT-NeoX, Llama in Hugging Face); it equals the interleaved
    pairing of the paper up to a fixed permutation of the q/k projection rows. cos/sin tables
    (context, Dh/2) are fp32 buffers, not parameters. ``kernel`` as RMSNorm's: "auto" runs
    `fastlm.rotary_embedding` (q and k in one launch each way) in eager mode, where PyTorch's
    version is about ten ops per tensor each way, and PyTorch ops while torch.compile traces, which
    Inductor fuses into its neighbouring kernels.
    """

    def __init__(self, head_dim: int, context_length: int, theta: float, kernel: str = "torch") -> None:
        super().__init__()
        self.kernel, self.theta = kernel, theta
        tables = (context_length, head_dim // 2)
        self.register_buffer("cos", torch.empty(tables, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(tables, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The cos/sin tables (buffers, no parameters: the name is the one `materialize` calls)."""
        context_length, half = self.cos.shape
        device = self.cos.device
        inverse_frequency = self.theta ** (
            -torch.arange(0, 2 * half, 2, dtype=torch.float64, device=device) / (2 * half)
        )
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64, device=device), inverse_frequency)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, H, N, Dh) -> the same shapes and dtypes, position p = index along N. A model cast
        to another dtype casts the tables too: the kernel gets them back in fp32 (no copy when they
        are), and float64 inputs, which it does not take, the PyTorch ops."""
        fused = self.kernel == "fastlm" or (self.kernel == "auto" and not torch.compiler.is_compiling())
        if fused and q.dtype in ROTARY_DTYPES:
            return rotary_embedding(q, k, self.cos.float(), self.sin.float())
        n = q.shape[-2]
        return rotate_half(q, self.cos[:n], self.sin[:n]), rotate_half(k, self.cos[:n], self.sin[:n])


def naive_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax: str = "torch", allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh) + causal mask) v with the (B, H, N, N) scores materialized; each
    stage is a named range so profiles can set softmax time against matmul time. ``softmax``
    "fastlm" fuses scale, causal mask and softmax into one `fastlm.masked_softmax` kernel.
    ``allowed`` (B or 1, 1, N, N) bool, `attention_mask`'s, narrows the causal mask further."""
    n, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
    if softmax == "fastlm":
        with annotate("attention/scores"):
            scores = q @ k.transpose(-2, -1)
        with annotate("attention/softmax"):
            extra = None
            if allowed is not None:
                extra = torch.zeros_like(allowed, dtype=q.dtype).masked_fill(~allowed, -math.inf)
            probs = masked_softmax(scores, extra, scale=scale, causal=True)
    else:
        with annotate("attention/scores"):
            scores = (q @ k.transpose(-2, -1)) * scale
        with annotate("attention/mask"):
            hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            if allowed is not None:
                hidden = hidden | ~allowed
            scores = scores.masked_fill(hidden, float("-inf"))
        with annotate("attention/softmax"):
            probs = torch.softmax(scores, dim=-1)
    with annotate("attention/output"):
        return probs.to(v.dtype) @ v


def document_segments(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(B, N) int: the document index of every token, from cumulative lengths over the B N tokens
    (empty documents at the end, padding, take no token)."""
    positions = torch.arange(batch * length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, positions, right=True).view(batch, length)


def attention_mask(segments: torch.Tensor | None, length: int, window: int | None, device) -> torch.Tensor:
    """(B or 1, 1, N, N) bool, True where query i may see key j beyond causality: the same document
    (``segments`` (B, N), or None: one per row) and, with ``window``, i - j < window."""
    query, key = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    allowed = key <= query if window is None else (key <= query) & (query - key < window)
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    return allowed.view(-1, 1, length, length)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        d = config.d_model
        self.num_heads, self.head_dim, self.kernel = config.num_heads, config.head_dim, config.attention
        self.softmax, self.window = config.softmax, window
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = Linear(d, d), Linear(d, d), Linear(d, d), Linear(d, d)
        self.rope = rope

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, N, d); fastlm reads the documents from ``cu_seqlens``, naive and sdpa from
        ``allowed``, this layer's `attention_mask` (None: plain causal attention)."""
        b, n, d = x.shape
        if self.kernel != "fastlm" and allowed is None and (cu_seqlens is not None or self.window is not None):
            raise ValueError("naive and sdpa attention take documents and windows as a mask (allowed)")

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, d) -> (B, H, N, Dh)
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q, k = self.rope(q, k)
        if self.kernel == "fastlm":
            out = self._flash(q, k, v, cu_seqlens)
        elif self.kernel == "naive":
            out = naive_causal_attention(q, k, v, self.softmax, allowed)
        elif allowed is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))

    def _flash(self, q, k, v, cu_seqlens) -> torch.Tensor:
        """q, k, v (B, H, N, Dh) -> (B, H, N, Dh); packed documents through the varlen kernels, whose
        longest document is at most a row (N)."""
        window = None if self.window is None else (self.window - 1, 0)
        if cu_seqlens is None:
            return flash_attention(q, k, v, causal=True, window=window)
        b, h, n, dh = q.shape

        def packed(t: torch.Tensor) -> torch.Tensor:  # (B, H, N, Dh) -> (B N, H, Dh)
            return t.transpose(1, 2).reshape(b * n, h, dh)

        out = flash_attention_varlen(
            packed(q), packed(k), packed(v), cu_seqlens, cu_seqlens, n, n, causal=True, window=window
        )
        return out.view(b, n, h, dh).transpose(1, 2)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(d_model, d_ff), Linear(d_model, d_ff), Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: int | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps, config.norm)
        self.attention = CausalSelfAttention(config, rope, window)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, config.norm)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, masks: dict | None = None
    ) -> torch.Tensor:
        """masks: `TransformerLM.attention_masks`'s, keyed by window."""
        allowed = None if masks is None else masks[self.attention.window]
        x = x + self.attention(self.attention_norm(x), cu_seqlens, allowed)
        return x + self.ffn(self.ffn_norm(x))


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
    ) -> torch.Tensor:
        """recompute: keep only each block's input for backward, which runs the block again."""
        for block in self:
            x = (
                checkpoint(block, x, cu_seqlens, masks, use_reentrant=False)
                if recompute
                else block(x, cu_seqlens, masks)
            )
        return x


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.d_model)
        rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, config.rope)
        self.blocks = BlockStack(Block(config, rope, config.layer_window(i)) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, config.norm)
        self.lm_head = Linear(config.d_model, config.vocab_size)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (B, N) int -> logits (B, N, V); with targets (B, N), the mean next-token loss;
        cu_seqlens as `hidden_states` takes it."""
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal tokens shape {tuple(tokens.shape)}")
        with annotate("forward"):
            x = self.hidden_states(tokens, cu_seqlens)  # (B, N, d)
            if targets is None:
                return self.lm_head(x)  # (B, N, V)
            if self.config.loss == "fastlm":  # the LM head's matmul inside the loss, chunk by chunk
                return linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
            return F.cross_entropy(self.lm_head(x).flatten(0, 1), targets.flatten())

    def hidden_states(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, N) int -> the final norm's output (B, N, d), what the LM head reads.

        cu_seqlens: None (each row one sequence), or int32 (S + 1,) on tokens' device, the
        cumulative lengths of the documents of the B N tokens laid end to end: rising from 0 to
        B N, with every row start among them (no document spans rows); trailing repeats of B N
        (empty documents) are allowed. Not checked on the GPU (that would wait for it)."""
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
        x = self.blocks(x, cu_seqlens, masks, self.config.recompute and torch.is_grad_enabled())
        return self.final_norm(x)

    def attention_masks(self, cu_seqlens, batch: int, length: int, device) -> dict | None:
        """naive and sdpa: the `attention_mask` of each window the blocks use ({window: mask, or None
        where plain causal attention does}), built once per forward, so every layer shares one
        tensor (SDPA keeps its mask for backward); None for fastlm, which takes cu_seqlens and
        skips tiles itself, and where nothing narrows causal attention."""
        if self.config.attention == "fastlm" or (cu_seqlens is None and self.config.window is None):
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
