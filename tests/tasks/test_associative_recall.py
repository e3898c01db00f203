"""Associative recall: generator properties, the hand-built model, training, the commands."""

import json

import pytest
import torch

from fastlm.cli import main
from fastlm.tasks.associative_recall import IGNORE_INDEX, RecallConfig, accuracy, handcrafted_model, make_splits
from fastlm.tasks.recall_training import TrainSettings, minimum_layers, train_depth

SMALL = RecallConfig(num_keys=8, num_values=8, num_pairs=4, num_train=2000, num_test=300, seed=1)


def _last_value(row: list[int], query: int) -> int:
    """The answer by the definition: scan the pairs, keep the last value paired with the query."""
    answer = None
    for i in range(0, len(row) - 1, 2):
        if row[i] == query:
            answer = row[i + 1]
    return answer


def test_every_answer_is_the_last_value_paired_with_the_query():
    config = RecallConfig(num_keys=4, num_pairs=10, num_train=500, num_test=100)  # 4 keys: many repeats
    train, _ = make_splits(config)
    for row, answer in zip(train.inputs.tolist(), train.answers.tolist(), strict=True):
        query = row[-1]
        assert query < config.num_keys and query in row[:-1:2]  # a key that is in the prefix
        assert answer == _last_value(row[:-1], query)
    assert all(config.num_keys <= t < config.vocab_size for t in train.inputs[:, 1:-1:2].flatten().tolist())


def test_lm_pairing_scores_only_the_answer():
    train, _ = make_splits(SMALL)
    assert train.inputs.shape == train.targets.shape == (SMALL.num_train, SMALL.input_length)
    assert (train.targets[:, :-1] == IGNORE_INDEX).all()
    # targets are the inputs shifted by one: the answer follows the query
    assert (train.targets[:, -1] >= SMALL.num_keys).all()


def test_splits_are_disjoint_and_deterministic():
    train, test = make_splits(SMALL)
    train_rows = {tuple(r) for r in torch.cat((train.inputs, train.answers[:, None]), 1).tolist()}
    test_rows = {tuple(r) for r in torch.cat((test.inputs, test.answers[:, None]), 1).tolist()}
    assert len(train_rows) == SMALL.num_train and len(test_rows) == SMALL.num_test
    assert not train_rows & test_rows
    again, _ = make_splits(SMALL)
    assert torch.equal(again.inputs, train.inputs)
    other, _ = make_splits(RecallConfig(**{**SMALL.__dict__, "seed": 2}))
    assert not torch.equal(other.inputs, train.inputs)


@pytest.mark.parametrize("config", [RecallConfig(seed=7), RecallConfig(num_keys=3, num_values=5, num_pairs=12, seed=3)])
def test_handcrafted_model_scores_100_percent_on_fresh_data(config):
    train, test = make_splits(config)
    model = handcrafted_model(config)
    assert accuracy(model, test) == 1.0
    assert accuracy(model, train) == 1.0


def test_handcrafted_model_needs_its_recency_term_when_keys_repeat():
    config = RecallConfig(num_keys=3, num_values=5, num_pairs=12, seed=3)
    _, test = make_splits(config)
    assert accuracy(handcrafted_model(config, recency=0.0), test) < 0.9  # ties average old and new values


def test_a_small_configuration_trains_to_90_percent():
    rows = train_depth(SMALL, make_splits(SMALL), 2, TrainSettings(d_model=32, num_heads=2, epochs=12, lr=3e-3))
    assert max(r["test_accuracy"] for r in rows) >= 0.9
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert minimum_layers(rows) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_pairs": 0}, "num_pairs must be a positive integer"),
        ({"num_keys": 1, "num_values": 1, "num_pairs": 2}, "too few"),
    ],
)
def test_bad_configs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        RecallConfig(**overrides)


def test_commands(tmp_path, capsys):
    assert main(["ar", "handcrafted", "--train", "200", "--test", "100"]) == 0
    assert "test accuracy 100.0%" in " ".join(capsys.readouterr().out.split())
    assert (
        main(
            [
                "ar",
                "train",
                "--layers",
                "1,2",
                "--epochs",
                "2",
                "--train",
                "300",
                "--test",
                "50",
                "--d-model",
                "16",
                "--heads",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("1 layer", "2 layer"))]
    # piped: each depth's line at once, then a line per epoch
    expected = [[f"{d} layer(s), epoch", *(f"{d} layer(s), epoch {e}/2" for e in (1, 2))] for d in (1, 2)]
    assert [line.split(":")[0] for line in progress] == [line for lines in expected for line in lines]
    records = [
        json.loads(line) for line in (tmp_path / "results" / "associative_recall.jsonl").read_text().splitlines()
    ]
    assert [(r["layers"], r["epoch"]) for r in records] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert (tmp_path / "reports" / "associative_recall.png").stat().st_size > 0
    assert main(["ar", "train", "--d-model", "10", "--heads", "3"]) == 2
    assert main(["ar", "handcrafted", "--keys", "1", "--values", "1", "--pairs", "2"]) == 2


def test_analyze_commands(capsys):
    assert main(["analyze", "mha"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "A100 SXM" in out and "N^2" in out
    assert main(["analyze", "mlp", "--d-model", "512", "--seq", "128", "--dtype", "bf16", "--gpu", "h100"]) == 0
    assert main(["analyze", "attention", "--d-model", "30", "--heads", "7"]) == 2
