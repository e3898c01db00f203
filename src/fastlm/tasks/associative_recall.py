"""Associative recall (AR): the standard probe of what attention layers can do.

A sequence is a prefix of key-value pairs followed by a query key; the answer is the value last
paired with that key:

    k3 v7 k1 v2 k3 v5 k0 v1 | k3  ->  v5        (keys may repeat: the latest pairing wins)

Tokens: keys are ids 0 .. num_keys-1, values num_keys .. num_keys+num_values-1, so one embedding
table serves both. The full sequence s has 2*num_pairs + 2 tokens (pairs, query, answer).

Language-model pairing: the model reads inputs = s[:-1] (pairs and the query, 2*num_pairs + 1
tokens) and at every position predicts the next token, targets = s[1:]. Only the last position,
the query's, has a determined answer: the others (a value after a key, a key after a value) are
random by construction, so their targets are IGNORE_INDEX and only the answer is scored. The
causal mask is what makes this a test of recall: each position sees only the tokens before it, so
the model cannot read the answer from the input, and the next-token objective at the query is
exactly "look up the value of this key".

Train and test splits are disjoint sets of sequences (no test sequence appears in training), and
everything is drawn from one `torch.Generator` seeded by `RecallConfig.seed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class RecallConfig:
    num_keys: int = 16
    num_values: int = 16
    num_pairs: int = 8
    num_train: int = 8000
    num_test: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_pairs", "num_train", "num_test"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        possible = self.num_keys**self.num_pairs * self.num_values**self.num_pairs
        if possible < 2 * (self.num_train + self.num_test):
            raise ValueError(
                f"only {possible} distinct prefixes exist for num_keys={self.num_keys}, num_values={self.num_values}, "
                f"num_pairs={self.num_pairs}: too few for {self.num_train} + {self.num_test} distinct sequences"
            )

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def input_length(self) -> int:
        """Tokens the model reads: the pairs and the query."""
        return 2 * self.num_pairs + 1


@dataclass(frozen=True)
class RecallSplit:
    inputs: torch.Tensor  # (n, 2P+1) int64: k v k v ... k v q
    targets: torch.Tensor  # (n, 2P+1) int64: IGNORE_INDEX everywhere but the last position (the answer)

    @property
    def answers(self) -> torch.Tensor:
        return self.targets[:, -1]

    def __len__(self) -> int:
        return self.inputs.shape[0]


def _sequences(config: RecallConfig, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` full sequences (count, 2P+2): pairs, a query key present in the prefix, its answer."""
    p = config.num_pairs
    keys = torch.randint(0, config.num_keys, (count, p), generator=generator)
    values = torch.randint(config.num_keys, config.vocab_size, (count, p), generator=generator)
    query_pair = torch.randint(0, p, (count,), generator=generator)  # the query is one of the prefix's keys
    query = keys[torch.arange(count), query_pair]
    # the answer is the value of the *last* pair whose key is the query
    matches = keys == query[:, None]  # (count, P)
    last = p - 1 - matches.flip(1).int().argmax(dim=1)
    answer = values[torch.arange(count), last]
    pairs = torch.stack((keys, values), dim=2).reshape(count, 2 * p)
    return torch.cat((pairs, query[:, None], answer[:, None]), dim=1)


def make_splits(config: RecallConfig) -> tuple[RecallSplit, RecallSplit]:
    """Disjoint train and test splits of distinct sequences, deterministic in ``config.seed``."""
    generator = torch.Generator().manual_seed(config.seed)
    wanted = config.num_train + config.num_test
    unique: dict[tuple[int, ...], None] = {}
    while len(unique) < wanted:
        for row in _sequences(config, wanted, generator).tolist():
            unique.setdefault(tuple(row), None)
    sequences = torch.tensor(list(unique)[:wanted])
    order = torch.randperm(wanted, generator=generator)
    train, test = sequences[order[: config.num_train]], sequences[order[config.num_train :]]
    return _lm_pairing(train), _lm_pairing(test)


def _lm_pairing(sequences: torch.Tensor) -> RecallSplit:
    inputs, targets = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    targets[:, :-1] = IGNORE_INDEX  # only the answer is scored
    return RecallSplit(inputs, targets)


# ---------------------------------------------------------------------------------------------
# A two-layer attention-only model that solves AR with weights set by hand
# ---------------------------------------------------------------------------------------------


class HandcraftedRecall(torch.nn.Module):
    """x = one_hot(token) + one_hot(position); two single-head attention layers with residual
    connections (no MLP, no norm); logits = x W_U. Weights come from `handcrafted_model`.

    Residual stream (width 3V + N + 1, V = vocabulary, N = input length), one block per meaning:
        tok   [0, V)         the token at this position               (embedding)
        prev  [V, 2V)        the token one position back              (written by layer 1)
        out   [2V, 3V)       the recalled value                        (written by layer 2)
        pos   [3V, 3V+N)     the position                              (embedding)
        one   3V+N           a constant 1, the "bias" of every query   (embedding)
    """

    def __init__(self, vocab_size: int, length: int) -> None:
        super().__init__()
        width = 3 * vocab_size + length + 1
        self.vocab_size, self.length = vocab_size, length
        self.token_embedding = torch.nn.Parameter(torch.zeros(vocab_size, width, dtype=torch.float64))
        self.position_embedding = torch.nn.Parameter(torch.zeros(length, width, dtype=torch.float64))
        # per layer: W_Q, W_K (width, width) score q.k without 1/sqrt(d); W_V W_O folded into one (width, width)
        self.query = torch.nn.Parameter(torch.zeros(2, width, width, dtype=torch.float64))
        self.key = torch.nn.Parameter(torch.zeros(2, width, width, dtype=torch.float64))
        self.value_output = torch.nn.Parameter(torch.zeros(2, width, width, dtype=torch.float64))
        self.unembedding = torch.nn.Parameter(torch.zeros(width, vocab_size, dtype=torch.float64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) -> logits (B, N, V)."""
        n = tokens.shape[1]
        x = self.token_embedding[tokens] + self.position_embedding[:n]
        future = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(1)
        for layer in range(2):
            scores = (x @ self.query[layer]) @ (x @ self.key[layer]).transpose(1, 2)  # (B, N, N)
            attention = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            x = x + attention @ (x @ self.value_output[layer])
        return x @ self.unembedding


def handcrafted_model(
    config: RecallConfig, *, sharpness: float | None = None, recency: float = 5.0
) -> HandcraftedRecall:
    """The two-layer solution, built with no training (see docs/associative_recall.md).

    Layer 1, previous-token head: the query of position p is its position one-hot, the key of
    position j is the one-hot of j+1, so the score is `sharpness` exactly where j = p-1; the head
    copies that token into `prev`. Layer 2, induction head: the query of position p is its token,
    the key of position j is its `prev` token, so the score is `sharpness` at every position right
    after an occurrence of the query key (the value paired with it), plus `recency * j` so the latest
    pairing wins, minus `sharpness` at position 0 (which has no predecessor and saw only itself in
    layer 1); the head copies that position's token into `out`. The read-out maps `out` to logits.
    ``sharpness`` defaults to 10 * recency * length, far above any recency difference.
    """
    v, n = config.vocab_size, config.input_length
    model = HandcraftedRecall(v, n)
    tok, prev, out, pos, one = 0, v, 2 * v, 3 * v, 3 * v + n
    sharp = 10.0 * recency * n if sharpness is None else sharpness
    eye_v, eye_n = torch.eye(v, dtype=torch.float64), torch.eye(n, dtype=torch.float64)
    with torch.no_grad():
        model.token_embedding[:, tok : tok + v] = eye_v
        model.position_embedding[:, pos : pos + n] = eye_n
        model.position_embedding[:, one] = 1.0
        # layer 1: q = pos(p), k = pos(j + 1): score sharp at j = p - 1; copy tok -> prev
        model.query[0, pos : pos + n, 0:n] = sharp * eye_n
        model.key[0, pos : pos + n - 1, 1:n] = eye_n[:-1, :-1]
        model.value_output[0, tok : tok + v, prev : prev + v] = eye_v
        # layer 2: q = [tok(p), 1], k = [prev(j), recency * j - sharp * (j == 0)]; copy tok -> out
        model.query[1, tok : tok + v, 0:v] = sharp * eye_v
        model.query[1, one, v] = 1.0
        model.key[1, prev : prev + v, 0:v] = eye_v
        model.key[1, pos : pos + n, v] = recency * torch.arange(n, dtype=torch.float64)
        model.key[1, pos, v] -= sharp
        model.value_output[1, tok : tok + v, out : out + v] = eye_v
        model.unembedding[out : out + v] = eye_v
    return model


@torch.no_grad()
def accuracy(model: torch.nn.Module, split: RecallSplit, batch: int = 1024) -> float:
    """Fraction of sequences whose answer is the argmax of the logits at the query position."""
    correct = 0
    for start in range(0, len(split), batch):
        logits = model(split.inputs[start : start + batch])[:, -1]
        correct += (logits.argmax(dim=-1) == split.answers[start : start + batch]).sum().item()
    return correct / len(split)
