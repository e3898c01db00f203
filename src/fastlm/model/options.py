"""The options that choose a command's model, declared once: `fastlm train` takes a preset, the
benchmarks and profilers a comma list of them (`fastlm.cli.models`); either way a dimension given
replaces the preset's. Without torch: the command line builds its parsers from these fields."""

from __future__ import annotations

from dataclasses import dataclass

from fastlm.model.config import PRESETS, ModelConfig
from fastlm.utils.errors import UserError
from fastlm.utils.options import check_limits, flag, option

# ModelConfig's field -> the option that sets it, for its error messages
FIELD_OPTIONS = {
    "d_model": "d_model",
    "d_ff": "d_ff",
    "num_layers": "layers",
    "num_heads": "heads",
    "context_length": "context",
    "vocab_size": "vocab",
    "global_every": "global_every",
}
# the mixture-of-experts options: ModelConfig field -> ModelOptions field
EXPERT_OPTIONS = {
    "num_experts": "experts",
    "experts_per_token": "experts_per_token",
    "expert_d_ff": "expert_d_ff",
    "shared_experts": "shared_experts",
    "moe_every": "moe_every",
    "router_aux_coef": "router_aux_coef",
}
FIELD_OPTIONS |= EXPERT_OPTIONS


@dataclass
class ModelOptions:
    preset: str | None = option(None, "model dimensions (default: small on a GPU, tiny without one)", choices=PRESETS)
    d_model: int | None = option(None, "width (default: the preset's)", limit="positive")
    d_ff: int | None = option(None, "MLP hidden width (default: the preset's)", limit="positive")
    layers: int | None = option(None, "Transformer blocks (default: the preset's)", limit="positive")
    heads: int | None = option(None, "attention heads (default: the preset's)", limit="positive")
    context: int = option(512, "tokens per sequence", limit="positive")
    window: int | None = option(
        None,
        "sliding-window attention: each token sees this many tokens back, itself included (default: the whole context)",
        limit="positive",
    )
    global_every: int = option(
        0, "with --window, every k-th block keeps global attention (0: none)", limit="non_negative"
    )
    experts: int | None = option(
        None, "a mixture of experts: experts per MoE block, 0 for a dense model (default: the preset's)",
        limit="non_negative",
    )  # fmt: skip
    experts_per_token: int | None = option(
        None, "experts each token is routed to (default: the preset's, else 2)", limit="positive"
    )
    expert_d_ff: int | None = option(
        None, "an expert's hidden width (default: the preset's, else --d-ff)", limit="positive"
    )
    shared_experts: int | None = option(
        None, "experts' worth of dense MLP every token passes through (default: the preset's, else 0)",
        limit="non_negative",
    )  # fmt: skip
    moe_every: int | None = option(
        None, "every k-th block is a mixture of experts (default: the preset's, else 1)", limit="positive"
    )
    router_aux_coef: float | None = option(
        None, "weight of the routers' load-balancing loss in the training loss (default: 0.01)", limit="non_negative"
    )

    def model_config(self, preset: str, vocab_size: int) -> ModelConfig:
        """``preset`` with the dimensions given and this context; UserError, naming the options,
        for dimensions that do not fit together."""
        check_limits(self, ModelOptions)
        dims = {"d_model": self.d_model, "d_ff": self.d_ff, "num_layers": self.layers, "num_heads": self.heads}
        dims |= {field: getattr(self, name) for field, name in EXPERT_OPTIONS.items()}
        try:
            return ModelConfig.preset(
                preset,
                vocab_size=vocab_size,
                context_length=self.context,
                window=self.window,
                global_every=self.global_every,
                **{k: v for k, v in dims.items() if v is not None},
            )
        except ValueError as error:
            message = str(error)
            for field, name in FIELD_OPTIONS.items():
                message = message.replace(field, flag(name))
            raise UserError(message) from None

    @property
    def custom(self) -> bool:
        """Whether a dimension replaces the preset's."""
        experts = (getattr(self, name) for name in EXPERT_OPTIONS.values())
        return any(v is not None for v in (self.d_model, self.d_ff, self.layers, self.heads, *experts))
