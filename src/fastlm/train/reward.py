"""`fastlm train reward`: a reward model (`fastlm.model.transformer.RewardModel`) trained on ranked
responses from a local JSONL file, one prompt per line:

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": "...", "responses": ["best", "second", ..., "worst"]}

Each response becomes the sequence prompt + response in the byte tokenizer (`fastlm.data.tokenizer`,
vocabulary 257), its last --context tokens when longer. A step draws --batch prompts of the
training split at random, scores every response (prompts with fewer responses are padded and
masked) and minimizes `fastlm.losses.ranking_loss` (for two responses the Bradley-Terry loss) with
AdamW under the learning-rate schedule of `fastlm train` (`fastlm.optim.schedule`). The held-out
prompts (--held-out of them, chosen by --seed) give the pairwise accuracy: the fraction of their
implied pairs (best > second, best > worst, ...) whose rewards are in the right order.

OUT/log.jsonl takes a record per --log-every steps and evaluation (`fastlm.train.log`: step, loss,
lr, grad_norm, eval_accuracy); OUT/reward_model.pt the final weights, with the model's dimensions
and the run's options as data. Sequences per step are (--batch x the most responses of a prompt).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from fastlm.data.tokenizer import load_tokenizer
from fastlm.losses import ranking_loss
from fastlm.model.precision import param_groups, precision_context
from fastlm.model.transformer import RewardModel
from fastlm.optim.schedule import warmup_cosine_lr
from fastlm.settings import STATE_BYTES, default_precision
from fastlm.train.config import RewardConfig
from fastlm.train.log import TrainLog, run_files, set_aside
from fastlm.train.loop import BETAS
from fastlm.utils.errors import UserError
from fastlm.utils.host_memory import check_fits_host
from fastlm.utils.options import check_limits
from fastlm.utils.paths import check_writable_folder

PROG = "fastlm train reward"
MODEL_FILE = "reward_model.pt"
REWARD_RUN_FILES = ("log.jsonl", MODEL_FILE)  # what a run writes in OUT: never replaced without --overwrite


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def read_rankings(path: Path, context: int) -> list[list[np.ndarray]]:
    """Per line of the JSONL ``path``: its responses best first, each the token ids of prompt +
    response (the last ``context``). UserError naming the line for one that is not a ranking."""
    encode = load_tokenizer("bytes").encode
    rankings = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--data {path} cannot be read as text: {error}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except json.JSONDecodeError as error:
            message = f"not valid JSON ({error.msg} at column {error.colno})"
            raise UserError(f"--data {path}, line {number}: {message}") from None
        responses = _responses(example)
        if responses is None:
            raise UserError(
                f"--data {path}, line {number}: expected a JSON object with a string prompt and strings "
                "chosen and rejected, or a list of at least 2 strings responses"
            )
        rankings.append([encode(example["prompt"] + response)[-context:] for response in responses])
    if len(rankings) < 2:
        raise UserError(f"--data {path} holds {len(rankings)} ranking(s); training and evaluation need at least 2")
    return rankings


def _responses(example) -> list[str] | None:
    """The ranked responses of one parsed line, or None when it is not a valid example."""
    if not isinstance(example, dict) or not isinstance(example.get("prompt"), str):
        return None
    responses = example.get("responses", [example.get("chosen"), example.get("rejected")])
    if not isinstance(responses, list) or len(responses) < 2 or not all(isinstance(r, str) for r in responses):
        return None
    return responses


def collate(rankings: list[list[np.ndarray]], device: torch.device):
    """B rankings of at most K responses -> tokens (B K, N) right-padded with 0, lengths (B K,)
    (1 for the padding rows, which the mask drops), mask (B, K) True at real responses."""
    k = max(len(r) for r in rankings)
    sequences = [r[i] if i < len(r) else r[0][:1] for r in rankings for i in range(k)]
    tokens = np.zeros((len(sequences), max(len(s) for s in sequences)), dtype=np.int64)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    mask = np.array([[i < len(r) for i in range(k)] for r in rankings])
    return (
        torch.from_numpy(tokens).to(device),
        torch.from_numpy(lengths).to(device),
        torch.from_numpy(mask).to(device),
    )


def pairwise_accuracy(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(pairs in the right order, pairs) of rewards (B, K) ranked best first, over the pairs i < j of
    unmasked columns; a tie counts as wrong."""
    k = rewards.shape[1]
    before = torch.ones(k, k, dtype=torch.bool, device=rewards.device).triu(1)
    pairs = before & mask[:, :, None] & mask[:, None, :]  # (B, K, K)
    right = pairs & (rewards[:, :, None] > rewards[:, None, :])
    return int(right.sum()), int(pairs.sum())


@torch.no_grad()
def evaluate(model: RewardModel, rankings: list[list[np.ndarray]], batch: int, device: torch.device, autocast) -> float:
    """Pairwise accuracy of ``model`` on ``rankings``."""
    right = total = 0
    for first in range(0, len(rankings), batch):
        tokens, lengths, mask = collate(rankings[first : first + batch], device)
        with autocast:
            rewards = model(tokens, lengths).view(mask.shape)
        right, total = (a + b for a, b in zip((right, total), pairwise_accuracy(rewards, mask), strict=True))
    return right / total


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def train(config: RewardConfig) -> dict:
    """Train and save the reward model (``config`` checked: `check`); returns {"losses" (per step),
    "eval" ([step, accuracy] pairs)}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = config.precision or default_precision(device.type == "cuda")
    rankings = read_rankings(config.data, config.context)
    order = np.random.default_rng(config.seed).permutation(len(rankings))
    held = min(max(1, round(config.held_out * len(rankings))), len(rankings) - 1)
    evaluation, training = [rankings[i] for i in order[:held]], [rankings[i] for i in order[held:]]
    torch.manual_seed(config.seed)
    preset = config.preset or ("small" if device.type == "cuda" else "tiny")
    model_config = config.model_config(preset, load_tokenizer("bytes").vocab_size)
    if device.type == "cpu":
        parameters = model_config.num_parameters()
        check_fits_host(
            STATE_BYTES[precision].total * parameters,
            f"the training state of the reward model (weights, gradients and AdamW moments of "
            f"{parameters / 1e9:.2f}B parameters)",
            "use a smaller model (--preset, --d-model, --layers)",
        )
    model = RewardModel(model_config).to(device)
    optimizer = torch.optim.AdamW(
        param_groups(model, precision, config.weight_decay), lr=config.lr, betas=BETAS, fused=device.type == "cuda"
    )
    autocast = precision_context(precision, device)
    draw = np.random.default_rng([config.seed, 1])
    losses, evals = [], []
    config.out.mkdir(parents=True, exist_ok=True)
    with TrainLog(config.out / "log.jsonl", config.steps, 0, True) as log:
        log.note(
            f"training a {preset} reward model ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
            f"{precision}) on {len(training)} ranked prompt(s), {held} held out for the accuracy; "
            f"{config.batch} prompts drawn per step"
        )
        if config.batch > len(training):
            log.note(f"--batch {config.batch} exceeds the {len(training)} training prompt(s): each step repeats them")
        for step in range(config.steps):
            lr = warmup_cosine_lr(
                step, lr=config.lr, min_lr=config.lr * config.min_lr_ratio, warmup=config.warmup, steps=config.steps
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens, lengths, mask = collate(
                [training[i] for i in draw.integers(len(training), size=config.batch)], device
            )
            with autocast:
                rewards = model(tokens, lengths).view(mask.shape)  # (batch, K)
            loss = ranking_loss(rewards, mask)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            done = step + 1
            record = {"step": done}
            if done % config.log_every == 0 or done == config.steps:
                record |= {"loss": float(np.mean(losses[-config.log_every :])), "lr": lr, "grad_norm": grad_norm.item()}
            if (config.eval_every and done % config.eval_every == 0) or done == config.steps:
                evals.append([done, evaluate(model, evaluation, config.batch, device, autocast)])
                record["eval_accuracy"] = evals[-1][1]
            if len(record) > 1:
                log.write(record)
            log.advance()
    torch.save(
        {
            "model": model.state_dict(),
            "model_config": dataclasses.asdict(model_config),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()},
        },
        config.out / MODEL_FILE,
    )
    print(f"wrote {config.out / MODEL_FILE} and {config.out / 'log.jsonl'}", flush=True)
    return {"losses": losses, "eval": evals}


def run(config: RewardConfig, prog: str = PROG) -> int:
    """`fastlm train reward`; 0 when done, 2 after a one-line error for a mistake in the arguments
    or the data."""
    try:
        check_limits(config)
        config.model_config(config.preset or "tiny", 1)  # dimensions that do not fit together
        try:
            check_writable_folder(config.out)
        except ValueError as error:
            raise UserError(f"--out {error}") from None
        earlier = run_files(config.out, REWARD_RUN_FILES)
        if earlier and not config.overwrite:
            raise UserError(
                f"--out {config.out} holds a reward run ({', '.join(earlier)}): choose another --out, or "
                "--overwrite to move it to OUT/previous-*"
            )
        set_aside(config.out, REWARD_RUN_FILES)
        train(config)
    except UserError as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0
