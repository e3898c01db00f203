"""TRL's preference trainer with fastlm's DPO loss: `DPOTrainer`, a drop-in subclass of
``trl.DPOTrainer`` whose policy loss is `fastlm.linear_dpo_loss`.

    from fastlm.integrations.huggingface import apply_fastlm
    from fastlm.integrations.trl import DPOTrainer

    apply_fastlm(model)                                   # the backbone's kernels (optional)
    trainer = DPOTrainer(model=model, ref_model=ref, args=trl.DPOConfig(...), ...)

TRL's own trainer scores the policy's tokens with its chunked log-probability head, which also
computes per-token entropies and mean logits for its metrics; this one runs the policy's backbone
(through the wrapped model, so DDP sees the forward) and hands its last hidden states to
`fastlm.linear_dpo_loss`: the loss and every gradient in one pass over groups of whole pairs, no
logits held. The reference log-probabilities come as in TRL (precomputed, or the reference model's
head under no_grad). Logged: the loss, rewards/*, logps/* and the token count, as TRL names them;
not logged: entropy, logits/* and mean_token_accuracy (they need the logits this path never holds).

The loss types served are TRL's "sigmoid", "robust", "hinge" and "ipo" alone (IPO's
length normalization included), with the reverse-KL divergence, no ``ld_alpha``, no WPO weighting,
no router auxiliary loss and a plain linear LM head (no adapter on it, no softcap of its logits);
any other configuration, and calls that ask for the outputs, run TRL's own loss (one warning when
the trainer is built).
SFT needs no subclass: ``trl.SFTTrainer`` runs a patched model's kernels, packed (padding-free) or
padded; its loss is TRL's head.

Tested with trl 1.16: this subclass follows that release's `DPOTrainer` internals.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch
import trl
from accelerate.utils import is_peft_model
from packaging.version import Version
from torch.distributed.tensor import DTensor

from fastlm.losses import linear_dpo_loss

if Version(trl.__version__) < Version("1.16"):
    raise ImportError(f"fastlm.integrations.trl needs trl >= 1.16 (its DPOTrainer internals), found {trl.__version__}")

# TRL's loss types that fastlm.linear_dpo_loss computes exactly (same names there)
SERVED_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
# the keys of a preference batch that are not the model's inputs (as TRL's trainer lists them)
_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


class DPOTrainer(trl.DPOTrainer):
    """``trl.DPOTrainer`` with the policy's DPO loss by `fastlm.linear_dpo_loss` (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fastlm_loss = self._fastlm_serves()
        if self.fastlm_loss:
            _add_hidden_states_forward(self._policy())

    def _policy(self):
        """The policy's transformers model (under PEFT, the adapted base model)."""
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    def _fastlm_serves(self) -> bool:
        """Whether this trainer's configuration is one fastlm's loss computes; warns once if not."""
        unserved = []
        head = self._policy().get_output_embeddings()
        if type(head) is not torch.nn.Linear:  # e.g. an adapter on the head: its weight alone is not the head
            unserved.append(f"an LM head of type {type(head).__name__}")
        if len(self.loss_types) != 1 or self.loss_types[0] not in SERVED_LOSS_TYPES:
            unserved.append(f"loss_type {self.loss_types}")
        elif self.loss_weights != [1.0]:
            unserved.append(f"loss_weights {self.loss_weights}")
        for name, value, served in (
            ("f_divergence_type", self.f_divergence_type, "reverse_kl"),
            ("ld_alpha", self.ld_alpha, None),
            ("use_weighting", self.use_weighting, False),
            ("the router auxiliary loss", self.aux_loss_enabled, False),
            ("final_logit_softcapping", getattr(self._policy().config, "final_logit_softcapping", None), None),
        ):
            if value != served:
                unserved.append(f"{name} {value}")
        if unserved:
            warnings.warn(
                f"fastlm's DPOTrainer computes TRL's loss for {', '.join(unserved)}: fastlm.linear_dpo_loss serves "
                f"the loss types {', '.join(SERVED_LOSS_TYPES)} alone, with reverse_kl, no ld_alpha, no weighting "
                "and no router auxiliary loss or logit softcap",
                stacklevel=3,
            )
        return not unserved

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.fastlm_loss or return_outputs:
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        completion_mask = inputs["completion_mask"]
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        hidden = model(**model_kwargs, fastlm_hidden_states=True).last_hidden_state
        # (2B, T - 1, d): chosen rows then rejected rows; position t predicts token t + 1. Prompt-learning
        # adapters prepend virtual tokens to the hidden states: the real tokens are the last T
        length = completion_mask.shape[1]
        hidden = hidden[:, -length:-1]
        targets = inputs["input_ids"][:, 1:]
        mask = completion_mask[:, 1:].bool()
        head = self._policy().get_output_embeddings()
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):  # FSDP2: the whole head for every rank's tokens
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()

        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            reference = self.model if self.ref_model is None else self.ref_model  # None: the adapter disabled
            ref_chosen, ref_rejected = self.compute_ref_log_probs(reference, inputs)
        loss_type = self.loss_types[0]
        ipo = loss_type == "ipo"
        tokens = mask.sum(1).clamp(min=1).float()
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        if ipo:  # IPO's scores are per-token means: the reference's sums divided the same way
            ref_chosen, ref_rejected = ref_chosen / chosen_tokens, ref_rejected / rejected_tokens
        out = linear_dpo_loss(
            hidden,
            weight,
            targets,
            mask,
            ref_chosen,
            ref_rejected,
            bias,
            beta=self.beta,
            label_smoothing=self.label_smoothing if loss_type == "robust" else 0.0,
            loss_type=loss_type,
            average_logps=ipo,
        )
        chosen_rewards, rejected_rewards = out.chosen_rewards, out.rejected_rewards
        if ipo:  # TRL logs the rewards of the sums
            chosen_rewards, rejected_rewards = chosen_rewards * chosen_tokens, rejected_rewards * rejected_tokens
            ref_chosen, ref_rejected = ref_chosen * chosen_tokens, ref_rejected * rejected_tokens
        self._log_dpo_metrics(mode, inputs, chosen_rewards, rejected_rewards, ref_chosen, ref_rejected)
        return out.loss

    def _log_dpo_metrics(self, mode, inputs, chosen_rewards, rejected_rewards, ref_chosen, ref_rejected):
        """TRL's metrics that need no logits, under TRL's names."""
        metrics, gather = self._metrics[mode], self.accelerator.gather
        if mode == "train":
            count = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += count // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(gather(chosen_rewards / self.beta + ref_chosen).mean().item())
        metrics["logps/rejected"].append(gather(rejected_rewards / self.beta + ref_rejected).mean().item())


def _add_hidden_states_forward(model) -> None:
    """``model(..., fastlm_hidden_states=True)`` returns its backbone's output (last_hidden_state
    and no logits); without it, the forward in place so far (TRL's fused head over the model's own)."""
    inner = model.forward

    @functools.wraps(type(model).forward)  # generate() validates its keyword arguments against the signature
    def forward(self, *args, fastlm_hidden_states: bool = False, **kwargs):
        if not fastlm_hidden_states:
            return inner(*args, **kwargs)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
