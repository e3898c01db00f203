"""`ModelConfig`: the dimensions of the language model and which kernels it runs, plus presets.

Presets follow the GPT-2 family sizes (small .. xl) and two larger ones, all with vocabulary 10000
and context 512 unless overridden; three more are mixtures of experts (`PRESET_EXPERTS`):
tiny-moe (CPU tests), small-moe (small's attention, 8 experts of width 1536, 2 per token) and
a3b-moe (Qwen3-30B-A3B's expert layer, 128 experts of width 768, 8 per token at d_model 2048, in
4 blocks instead of its 48).

    >>> config = ModelConfig.preset("small").with_kernels(attention="fastlm", loss="fastlm")
    >>> config.num_parameters()
    128625408
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastlm.settings import Kernels

# name -> (d_model, d_ff, num_layers, num_heads)
PRESET_DIMENSIONS = {
    "tiny": (64, 128, 2, 4),  # CPU tests
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7b": (2560, 10240, 32, 32),
    "10b": (4608, 12288, 50, 36),
    "tiny-moe": (64, 128, 2, 4),
    "small-moe": (768, 3072, 12, 12),
    "a3b-moe": (2048, 6144, 4, 16),
}
# name -> the mixture-of-experts fields of the presets that have them
PRESET_EXPERTS = {
    "tiny-moe": {"num_experts": 4, "experts_per_token": 2, "expert_d_ff": 64},
    "small-moe": {"num_experts": 8, "experts_per_token": 2, "expert_d_ff": 1536},
    "a3b-moe": {"num_experts": 128, "experts_per_token": 8, "expert_d_ff": 768},
}
PRESETS = tuple(PRESET_DIMENSIONS)


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10000
    context_length: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    kernels: Kernels = Kernels()  # which kernel each layer runs (fastlm.settings)
    # sliding-window attention: each query sees the last ``window`` tokens (itself included) of its
    # document; with global_every = k every k-th layer (k-1, 2k-1, ...) stays global (Gemma 2: 2)
    window: int | None = None
    global_every: int = 0
    # keep only each block's input for backward and run its forward again there (torch.utils.checkpoint):
    # activations of one block at a time instead of all of them, for a third more compute
    recompute: bool = False
    # a mixture of experts where num_experts > 0: every moe_every-th block (moe_every - 1,
    # 2 moe_every - 1, ...) replaces its dense MLP by num_experts SwiGLU experts of width
    # expert_d_ff (default: d_ff), experts_per_token of them per token, plus shared_experts
    # experts' worth of a dense MLP every token passes through (`fastlm.layers.moe.MoEMLP`); the
    # training loss adds router_aux_coef x the load-balancing loss and router_z_coef x the z-loss,
    # each the mean over those blocks
    num_experts: int = 0
    experts_per_token: int = 2
    expert_d_ff: int | None = None
    shared_experts: int = 0
    moe_every: int = 1
    router_aux_coef: float = 0.01
    router_z_coef: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):  # the config read back from JSON (dataclasses.asdict's form)
            object.__setattr__(self, "kernels", Kernels(**self.kernels))
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"window must be a positive integer or None, got {self.window!r}")
        if not isinstance(self.global_every, int) or self.global_every < 0:
            raise ValueError(f"global_every must be an integer >= 0, got {self.global_every!r}")
        if self.global_every and self.window is None:
            raise ValueError("global_every needs a window: without one every block is global already")
        self._check_experts()
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / num_heads must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.kernels, Kernels):
            raise TypeError(f"kernels must be a fastlm.settings.Kernels, got {type(self.kernels).__name__}")

    def _check_experts(self) -> None:
        for name in ("num_experts", "shared_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("experts_per_token", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.expert_d_ff is not None and (not isinstance(self.expert_d_ff, int) or self.expert_d_ff <= 0):
            raise ValueError(f"expert_d_ff must be a positive integer or None, got {self.expert_d_ff!r}")
        for name in ("router_aux_coef", "router_z_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be at most num_experts ({self.num_experts})"
            )

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The named preset (`PRESETS`) with any field overridden."""
        try:
            d_model, d_ff, num_layers, num_heads = PRESET_DIMENSIONS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
        dimensions = {"d_model": d_model, "d_ff": d_ff, "num_layers": num_layers, "num_heads": num_heads}
        return cls(**{**dimensions, **PRESET_EXPERTS.get(name, {}), **overrides})

    def with_kernels(self, kernels: str | Kernels | None = None, **switches: str) -> ModelConfig:
        """This config with other kernels: a kernel set by name ("torch" or "fastlm", `Kernels.named`)
        or a `Kernels`, then any single switch given (``attention="naive"``) on top of it."""
        base = self.kernels if kernels is None else Kernels.named(kernels) if isinstance(kernels, str) else kernels
        return dataclasses.replace(self, kernels=base.replace(**switches))

    def record_fields(self) -> dict:
        """The config as flat JSON data, the switches beside the dimensions (benchmark records)."""
        fields = dataclasses.asdict(self)
        return {**fields, **fields.pop("kernels")}

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (0-based): ``window``, or None where the block is global."""
        if self.window is None or (self.global_every and (layer + 1) % self.global_every == 0):
            return None
        return self.window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (0-based) is a mixture of experts."""
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        """The blocks that are mixtures of experts, in order."""
        return [layer for layer in range(self.num_layers) if self.is_moe_layer(layer)]

    @property
    def expert_width(self) -> int:
        """An expert's hidden width: expert_d_ff, or d_ff where it is not given."""
        return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

    def _mlp_parameters(self, layer: int, *, active: bool) -> int:
        """The matmul weights of block ``layer``'s MLP: dense SwiGLU 3*d*d_ff; a mixture of experts
        the router E*d, 3*d*I per expert (all E, or the experts_per_token a token uses when
        ``active``) and 3*d*I per shared expert."""
        d = self.d_model
        if not self.is_moe_layer(layer):
            return 3 * d * self.d_ff
        experts = self.experts_per_token if active else self.num_experts
        return self.num_experts * d + 3 * d * self.expert_width * (experts + self.shared_experts)

    def num_block_parameters(self, layer: int = 0) -> int:
        """Parameters of block ``layer``: q, k, v, o projections 4*d^2; the MLP (`_mlp_parameters`);
        two RMSNorm weights 2*d."""
        return 4 * self.d_model**2 + self._mlp_parameters(layer, active=False) + 2 * self.d_model

    def num_blocks_parameters(self) -> int:
        """Parameters of all the blocks."""
        return sum(self.num_block_parameters(layer) for layer in range(self.num_layers))

    def num_parameters(self, *, embedding: bool = True) -> int:
        """Parameters of the model, counted from the dimensions (nothing is allocated): the blocks
        (`num_block_parameters` each), the final norm d, the LM head d*V and the embedding V*d."""
        d = self.d_model
        total = self.num_blocks_parameters() + d + d * self.vocab_size
        return total + (self.vocab_size * d if embedding else 0)

    def num_matmul_parameters(self, *, active: bool = False) -> int:
        """Weights that take part in a matrix multiply (every projection and the LM head); with
        ``active``, those one token's forward uses (a mixture of experts' K experts of E): the N of
        the 6*N*tokens training-FLOPs rule. Excludes the embedding (a lookup) and norm weights."""
        blocks = sum(
            4 * self.d_model**2 + self._mlp_parameters(layer, active=active) for layer in range(self.num_layers)
        )
        return blocks + self.d_model * self.vocab_size
