"""TRL's trainers on tiny random Llama models, a few optimizer steps each (fp32, CPU): fastlm's
`DPOTrainer` (the policy loss by fastlm.linear_dpo_loss) against trl.DPOTrainer for every loss type
it serves, with precomputed reference log-probabilities, under a LoRA adapter, and falling back to
TRL's loss for a configuration it does not serve; trl.SFTTrainer with a patched model, packed
(padding-free) and padded, against the unpatched model.

The ops take their PyTorch reference paths on CPU tensors (TRITON_INTERPRET unset, as in
test_huggingface_families.py): what these runs check is the wiring between TRL's trainers and
fastlm (which inputs reach which op, the reference log-probabilities, the metrics), over several
steps; one step of each kernel under the interpreter is test_huggingface.py's and test_losses.py's."""

import copy

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

import fastlm.integrations.trl as fastlm_trl  # noqa: E402
from fastlm.integrations.huggingface import apply_fastlm  # noqa: E402

from . import test_huggingface  # noqa: E402

op_calls = test_huggingface.op_calls  # the fixture counting the fastlm ops the patch runs

WORDS = [f"w{i}" for i in range(40)]
# each step's loss and metrics: the kernels against PyTorch's fp32 ops differ in summation order only
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(autouse=True)
def reference_paths(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer of `WORDS` (ids from 2) with pad 0 and eos 1: nothing to download."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", pad_token="<pad>")


def tiny_policy(family: str):
    return test_huggingface.tiny_model(family, vocab_size=len(WORDS) + 2, eos_token_id=1, bos_token_id=1)


def sentences(count: int, shortest: int, longest: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist()) for n in lengths]


def preference_data(pairs: int = 8):
    """Prompts (ending in a space, so that prompt + completion tokenize at the boundary) and chosen
    and rejected completions of different lengths."""
    prompts = [p + " " for p in sentences(pairs, 2, 5, seed=1)]
    return datasets.Dataset.from_dict(
        {"prompt": prompts, "chosen": sentences(pairs, 1, 6, seed=2), "rejected": sentences(pairs, 1, 6, seed=3)}
    )


def common_args(tmp_path, name: str) -> dict:
    return dict(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=4,
        max_steps=2,
        # SGD: the weights move by the gradients themselves (Adam's first steps move a weight by
        # about lr whatever its gradient's size, so a rounding-level difference could show as lr)
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        bf16=False,
    )


def dpo_run(trainer_class, model, tokenizer, tmp_path, name, ref=True, peft_config=None, **options):
    """Two DPO steps: (each step's logged metrics, the trained model)."""
    args = trl.DPOConfig(**common_args(tmp_path, name), **options)
    reference = copy.deepcopy(model) if ref else None
    trainer = trainer_class(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=preference_data(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry], trainer.model


# the metrics fastlm's trainer logs, as TRL names them
DPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def assert_same_dpo(logs, expected, model, expected_model):
    assert len(logs) == len(expected) == 2
    # not rewards/accuracies: at the first step the policy is the reference, and its rewards are 0
    # up to rounding, so that which of a pair's is larger is a coin toss
    for key in (*DPO_METRICS, "num_tokens"):
        torch.testing.assert_close(
            torch.tensor([e[key] for e in logs]),
            torch.tensor([e[key] for e in expected]),
            **CLOSE,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    assert logs[1]["rewards/margins"] != 0  # the second step follows a real update
    for (name, param), expected_param in zip(model.named_parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(param, expected_param, **CLOSE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def dpo_calls(monkeypatch):
    """Counts the calls of fastlm.linear_dpo_loss by the trainer."""
    calls, loss = [], fastlm_trl.linear_dpo_loss

    def counting(*args, **kwargs):
        calls.append(kwargs["loss_type"])
        return loss(*args, **kwargs)

    monkeypatch.setattr(fastlm_trl, "linear_dpo_loss", counting)
    return calls


@pytest.mark.parametrize(
    "options",
    [
        {},  # sigmoid
        {"loss_type": ["ipo"], "beta": 0.5},
        {"loss_type": ["robust"], "label_smoothing": 0.2},
        {"loss_type": ["hinge"]},
        {"precompute_ref_log_probs": True},
    ],
    ids=["sigmoid", "ipo", "robust", "hinge", "precomputed-reference"],
)
def test_dpo_trainer_matches_trls(options, tokenizer, tmp_path, dpo_calls, recwarn):
    model = tiny_policy("llama")
    expected, expected_model = dpo_run(trl.DPOTrainer, copy.deepcopy(model), tokenizer, tmp_path, "trl", **options)
    logs, trained = dpo_run(fastlm_trl.DPOTrainer, model, tokenizer, tmp_path, "fastlm", **options)
    assert dpo_calls == [options.get("loss_type", ["sigmoid"])[0]] * 2
    assert_same_dpo(logs, expected, trained, expected_model)
    assert not [w for w in recwarn if "fastlm's DPOTrainer" in str(w.message)]


def test_dpo_trainer_runs_a_patched_model(tokenizer, tmp_path, dpo_calls, op_calls):
    """The padded preference batch runs the patched backbone's kernels (padding by unpadding) and
    fastlm's loss; the same steps as TRL's trainer over the unpatched model."""
    model = tiny_policy("llama")
    expected, expected_model = dpo_run(trl.DPOTrainer, copy.deepcopy(model), tokenizer, tmp_path, "trl")
    apply_fastlm(model)
    logs, trained = dpo_run(fastlm_trl.DPOTrainer, model, tokenizer, tmp_path, "fastlm")
    assert len(dpo_calls) == 2 and op_calls["flash_attention_varlen"] > 0 and op_calls["rms_norm"] > 0
    assert_same_dpo(logs, expected, trained, expected_model)


def test_dpo_trainer_under_a_lora_adapter(tokenizer, tmp_path, dpo_calls):
    """PEFT: no reference model (the adapter disabled is the reference); the adapter's weights train."""
    peft = pytest.importorskip("peft")
    model = tiny_policy("llama")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    options = dict(ref=False)
    expected, expected_model = dpo_run(
        trl.DPOTrainer, copy.deepcopy(model), tokenizer, tmp_path, "trl", peft_config=lora(), **options
    )
    logs, trained = dpo_run(fastlm_trl.DPOTrainer, model, tokenizer, tmp_path, "fastlm", peft_config=lora(), **options)
    assert len(dpo_calls) == 2
    assert_same_dpo(logs, expected, trained, expected_model)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llama", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
        ("llama", {"f_divergence_type": "js_divergence"}),
        ("gemma2", {}),  # its logits softcapped (final_logit_softcapping), which linear_dpo_loss does not do
    ],
    ids=["mixed-losses", "js-divergence", "softcapped-logits"],
)
def test_an_unserved_configuration_runs_trls_loss_with_a_warning(family, options, tokenizer, tmp_path, dpo_calls):
    model = tiny_policy(family)
    expected, _ = dpo_run(trl.DPOTrainer, copy.deepcopy(model), tokenizer, tmp_path, "trl", **options)
    with pytest.warns(UserWarning, match="fastlm's DPOTrainer computes TRL's loss"):
        logs, _ = dpo_run(fastlm_trl.DPOTrainer, model, tokenizer, tmp_path, "fastlm", **options)
    assert dpo_calls == []
    assert [e["loss"] for e in logs] == pytest.approx([e["loss"] for e in expected], rel=1e-6)
    assert "entropy" in logs[0]  # TRL's own metrics, from its head


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_trainer_runs_the_patched_model(packing, tokenizer, tmp_path, op_calls, recwarn):
    """Packed: one row of whole documents, position ids restarting (TRL's padding-free default),
    through the variable-length kernel; padded: each row's real tokens, by unpadding. Two steps,
    the unpatched model's losses."""
    data = datasets.Dataset.from_dict({"text": sentences(16, 3, 11, seed=4)})

    def losses(model, name):
        options = dict(common_args(tmp_path, name), packing=packing, max_length=32)
        args = trl.SFTConfig(**options)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    model = tiny_policy("llama")
    expected = losses(copy.deepcopy(model), "unpatched")
    apply_fastlm(model)
    measured = losses(model, "patched")
    # 2 layers x 2 steps x 2: TRL's default gradient checkpointing runs each forward again in backward
    assert op_calls["flash_attention_varlen"] == 8 and op_calls["flash_attention"] == 0
    assert measured == pytest.approx(expected, rel=1e-5)
    assert not test_huggingface.fallback_warnings(recwarn)
