"""`ModelConfig`: the dimensions of the language model and which kernels it runs, plus presets.

Presets follow the GPT-2 family sizes (small .. xl) and two larger ones, all with vocabulary 10000
and context 512 unless overridden:

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
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / num_heads must be even for RoPE, got {self.head_dim}")
        if not isinstance(self.kernels, Kernels):
            raise TypeError(f"kernels must be a fastlm.settings.Kernels, got {type(self.kernels).__name__}")

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The named preset (tiny, small, medium, large, xl, 2.7b, 10b) with any field overridden."""
        try:
            d_model, d_ff, num_layers, num_heads = PRESET_DIMENSIONS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
        dimensions = {"d_model": d_model, "d_ff": d_ff, "num_layers": num_layers, "num_heads": num_heads}
        return cls(**{**dimensions, **overrides})

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

    def num_block_parameters(self) -> int:
        """Parameters of one block: q, k, v, o projections 4*d^2; SwiGLU w1, w3 (d -> d_ff) and w2
        (d_ff -> d) 3*d*d_ff; two RMSNorm weights 2*d."""
        return 4 * self.d_model**2 + 3 * self.d_model * self.d_ff + 2 * self.d_model

    def num_parameters(self, *, embedding: bool = True) -> int:
        """Parameters of the model, counted from the dimensions (nothing is allocated): the blocks
        (`num_block_parameters` each), the final norm d, the LM head d*V and the embedding V*d."""
        d = self.d_model
        total = self.num_layers * self.num_block_parameters() + d + d * self.vocab_size
        return total + (self.vocab_size * d if embedding else 0)

    def num_matmul_parameters(self) -> int:
        """Weights that take part in a matrix multiply (every projection and the LM head): the N of
        the 6*N*tokens training-FLOPs rule. Excludes the embedding (a lookup) and norm weights."""
        return self.num_layers * (4 * self.d_model**2 + 3 * self.d_model * self.d_ff) + self.d_model * self.vocab_size
