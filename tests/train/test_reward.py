"""`fastlm train reward` on a synthetic preference task whose rule is known: it learns the rule (held-out
pairwise accuracy far above chance), reads both JSONL forms, and refuses bad lines in one sentence."""

import json
import random

import pytest
import torch

from fastlm.cli import main
from fastlm.model.config import ModelConfig
from fastlm.model.transformer import RewardModel
from fastlm.train import reward
from fastlm.train.log import read_log
from fastlm.utils import host_memory

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def response(stars: int, rng: random.Random) -> str:
    """Eight random letters with ``stars`` of them replaced by '*' at random places."""
    chars = [rng.choice(LETTERS) for _ in range(8)]
    for place in rng.sample(range(8), stars):
        chars[place] = "*"
    return "".join(chars)


def synthetic_rankings(count: int, seed: int = 0) -> list[dict]:
    """The rule: the response with more '*' is preferred. Prompts of random letters; half the lines
    are pairs {prompt, chosen, rejected}, half rankings of three {prompt, responses}."""
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        prompt = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 6))) + ":"
        k = 2 if index % 2 else 3
        stars = sorted(rng.sample(range(5), k), reverse=True)  # distinct counts, best first
        responses = [response(s, rng) for s in stars]
        lines.append(
            {"prompt": prompt, "responses": responses}
            if k == 3
            else {"prompt": prompt, "chosen": responses[0], "rejected": responses[1]}
        )
    return lines


def write_jsonl(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_reward_model_learns_the_rule_on_held_out_prompts(tmp_path):
    data = tmp_path / "prefs.jsonl"
    write_jsonl(data, synthetic_rankings(1000))
    out = tmp_path / "run"
    argv = [
        "train",
        "reward",
        "--data",
        str(data),
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--context",
        "32",
        "--steps",
        "200",
        "--batch",
        "16",
        "--lr",
        "3e-3",
        "--held-out",
        "0.2",
        "--eval-every",
        "100",
    ]
    assert main(argv) == 0
    records = read_log(out / "log.jsonl")
    accuracies = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    assert len(accuracies) == 2
    assert accuracies[-1] >= 0.95, accuracies  # chance: 0.5
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
    saved = torch.load(out / reward.MODEL_FILE)
    model = RewardModel(ModelConfig(**saved["model_config"]))
    model.load_state_dict(saved["model"])
    assert "lm_head.weight" not in saved["model"] and saved["config"]["steps"] == 200


def test_a_second_run_never_replaces_the_first_without_overwrite(tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    write_jsonl(data, synthetic_rankings(40))
    out = tmp_path / "run"
    argv = [
        "train",
        "reward",
        "--data",
        str(data),
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--context",
        "32",
        "--steps",
        "2",
        "--batch",
        "4",
    ]
    assert main(argv) == 0
    out_text = capsys.readouterr().out
    assert "on 36 ranked prompt(s), 4 held out for the accuracy; 4 prompts drawn per step" in out_text
    assert f"wrote {out / 'reward_model.pt'} and {out / 'log.jsonl'}" in out_text
    first_log = (out / "log.jsonl").read_text()
    assert main(argv) == 2
    assert "holds a reward run (log.jsonl, reward_model.pt)" in capsys.readouterr().err
    assert (out / "log.jsonl").read_text() == first_log
    assert main([*argv, "--overwrite"]) == 0
    (aside,) = out.glob("previous-*")
    assert (aside / "log.jsonl").read_text() == first_log and (aside / reward.MODEL_FILE).exists()
    capsys.readouterr()
    assert main([*argv[:-1], "64", "--overwrite"]) == 0
    assert "--batch 64 exceeds the 36 training prompt(s): each step repeats them" in capsys.readouterr().out


def test_collate_pads_short_rankings_and_masks_them():
    rankings = [
        [torch.tensor([1, 2, 3]).numpy(), torch.tensor([4]).numpy()],
        [torch.tensor([5, 6]).numpy(), torch.tensor([7, 8]).numpy(), torch.tensor([9]).numpy()],
    ]
    tokens, lengths, mask = reward.collate(rankings, torch.device("cpu"))
    assert tokens.tolist() == [[1, 2, 3], [4, 0, 0], [1, 0, 0], [5, 6, 0], [7, 8, 0], [9, 0, 0]]
    assert lengths.tolist() == [3, 1, 1, 2, 2, 1]
    assert mask.tolist() == [[True, True, False], [True, True, True]]


def test_pairwise_accuracy_counts_the_implied_pairs():
    rewards = torch.tensor([[3.0, 1.0, 2.0], [0.0, 1.0, 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: 3>1 right, 3>2 right, 1>2 wrong; row 1: 0>1 wrong
    assert reward.pairwise_accuracy(rewards, mask) == (2, 4)


def test_reward_is_read_at_the_last_real_token():
    """Right padding changes nothing: causal attention keeps it out of earlier positions."""
    model = RewardModel(ModelConfig.preset("tiny", vocab_size=64, context_length=16))
    tokens = torch.randint(0, 64, (2, 10))
    padded = tokens.clone()
    padded[0, 6:] = 0
    lengths = torch.tensor([6, 10])
    torch.testing.assert_close(model(padded, lengths), model(tokens, lengths))
    assert model(tokens, torch.tensor([5, 10]))[0] != model(tokens, lengths)[0]


@pytest.mark.parametrize(
    "line,what",
    [
        ("not json", "line 2: not valid JSON (Expecting value at column 1)"),
        ('{"prompt": "p", "chosen": "a"}', "line 2: expected a JSON object"),
        ('{"prompt": "p", "responses": ["only one"]}', "list of at least 2 strings"),
    ],
)
def test_bad_line_is_one_sentence_naming_it(line, what, tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps(synthetic_rankings(1)[0]) + "\n" + line + "\n")
    assert main(["train", "reward", "--data", str(data), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("fastlm train reward: error: --data") and what in error


def test_lm_options_before_reward_are_refused(tmp_path, capsys):
    """`fastlm train --lr 5 reward ...` would train with reward's own --lr: refused, naming them."""
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--parallel", "ddp", "--lr", "5", "reward", "--data", str(tmp_path / "x.jsonl")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("fastlm train: error: --lr, --parallel before 'reward' would be ignored")


def test_a_cpu_run_stops_before_building_a_model_the_host_cannot_hold(tmp_path, capsys, monkeypatch):
    """`fastlm train reward --preset 10b` on a CPU: one line before the model is built."""
    if torch.cuda.is_available():
        pytest.skip("the check is a CPU run's")
    data = tmp_path / "prefs.jsonl"
    write_jsonl(data, synthetic_rankings(10))
    monkeypatch.setattr(host_memory, "host_memory", lambda: 64 * 10**9)
    monkeypatch.setattr(reward, "RewardModel", lambda config: pytest.fail("the model was built"))
    argv = ["train", "reward", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "10b"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "on a CPU, the training state of the reward model (weights, gradients and AdamW moments of " in error
    assert "more than half of the 64.0 GB here; use a smaller model (--preset, --d-model, --layers)" in error
