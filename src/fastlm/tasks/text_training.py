"""`fastlm train lm`: train the language model on a byte-level text corpus, once per kernel set.

Tokens are the file's UTF-8 bytes (vocabulary 256). The last 10% of the bytes are held out; the
rest is cut into non-overlapping windows of context + 1 bytes (inputs and next-byte targets). An
epoch visits every window once in an order drawn from the seed, in batches of `batch`.

Every kernel set (`torch`: SDPA, PyTorch norm and loss; `fastlm`: the fused kernels) starts from
the same initial weights and sees the same batches in the same order, so the loss curves differ
only by the kernels' rounding: they should lie on top of each other, and the epoch times show what
the kernels buy. Each run reports its epoch time (synchronized), tokens/s, the loss of every step
and the held-out loss after the epoch.

`compile` runs the model eager, under `torch.compile`, or under `torch.compile(mode=
"reduce-overhead")` (`cudagraphs`: each step replays CUDA graphs, so kernel launches cost no CPU
time; small models are launch-bound in eager mode). Compilation and graph recording happen in a
warm-up of the timed model on both batch shapes an epoch has (the last batch may be short), not in
the timed epoch.
"""

from __future__ import annotations

import contextlib
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fastlm.bench.model import TORCH_COMPILE_MODE
from fastlm.bench.report import save_figure
from fastlm.model import ModelConfig, TransformerLM

HELD_OUT = 0.1
VOCAB = 256


@dataclass(frozen=True)
class TextSettings:
    preset: str = "tiny"
    context: int = 128
    batch: int = 16
    epochs: int = 1
    lr: float = 1e-3
    precision: str = "fp32"  # or "bf16" (autocast)
    seed: int = 0
    compile: str = "eager"  # or "compile", "cudagraphs"


def load_corpus(path: Path) -> torch.Tensor:
    """The file's bytes as int64 tokens; ValueError when it is not UTF-8 text."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split_windows(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train windows, held-out windows), each (n, context + 1); ValueError if either is empty."""
    cut = int(len(tokens) * (1 - HELD_OUT))
    parts = []
    for name, part in (("training", tokens[:cut]), ("held-out", tokens[cut:])):
        n = len(part) // (context + 1)
        if n == 0:
            raise ValueError(f"the corpus is too small: its {name} part ({len(part)} bytes) holds no window "
                             f"of {context + 1} bytes (context + 1); use more text or a smaller --context")  # fmt: skip
        parts.append(part[: n * (context + 1)].view(n, context + 1))
    return parts[0], parts[1]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(model: TransformerLM, compile_mode: str) -> Callable:
    """The callable a step runs: the model itself, or its compiled form."""
    if compile_mode == "eager":
        return model
    return torch.compile(model, mode=TORCH_COMPILE_MODE[compile_mode])


def _warm_up(model: TransformerLM, forward: Callable, batches: Sequence[torch.Tensor], settings: TextSettings,
             autocast, device: torch.device) -> None:  # fmt: skip
    """Three forward and backward passes per batch shape on the model about to be timed, without an
    optimizer step, so its weights stay those of the other kernel sets: Triton and torch.compile
    compile, CUDA graphs are recorded (for this model's parameter addresses) and the allocator
    grows here, not in the timed epoch. CUDA graph trees run a new graph eagerly once, record it on
    the second call and replay from the third, so each shape has replayed before the clock starts.
    The gradients are dropped before every pass, as the epoch's steps do: under CUDA graphs they
    are graph outputs, dead once the next step begins, and accumulating into them fails."""
    for batch in batches:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            _mark_step(settings.compile)
            with autocast:
                forward(batch[:, :-1], batch[:, 1:]).backward()
    model.zero_grad(set_to_none=True)
    _synchronize(device)


def _mark_step(compile_mode: str) -> None:
    if compile_mode == "cudagraphs":
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are dead


def train_kernels(
    windows: tuple[torch.Tensor, torch.Tensor],
    kernels: str,
    settings: TextSettings,
    device: torch.device,
    on_step: Callable[[int, float], None] = lambda step, loss: None,
) -> dict:
    """Train a fresh model with ``kernels`` for ``settings.epochs`` epochs; a record of the run."""
    train, held_out = windows
    config = ModelConfig.preset(settings.preset, vocab_size=VOCAB, context_length=settings.context)
    config = config.with_kernels(kernels)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if settings.precision == "bf16"
                else contextlib.nullcontext())  # fmt: skip
    torch.manual_seed(settings.seed)
    with torch.device(device):
        model = TransformerLM(config)
    forward = _prepare(model, settings.compile)
    if device.type == "cuda" or settings.compile != "eager":  # (eager CPU compiles nothing on first use)
        shapes = [train[: settings.batch]]
        if len(train) % settings.batch:
            shapes.append(train[: len(train) % settings.batch])  # the short last batch
        _warm_up(model, forward, [batch.to(device) for batch in shapes], settings, autocast, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(settings.seed)
    losses, epoch_seconds, step = [], [], 0
    for _ in range(settings.epochs):
        order = torch.randperm(len(train), generator=generator)
        losses_on_device = []
        _synchronize(device)
        start = timeit.default_timer()
        for first in range(0, len(train), settings.batch):
            batch = train[order[first : first + settings.batch]].to(device, non_blocking=True)
            _mark_step(settings.compile)
            with autocast:
                loss = forward(batch[:, :-1], batch[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = loss.detach()
            # a CUDA graph's output is overwritten by the next replay: keep a copy in that mode only
            losses_on_device.append(loss.clone() if settings.compile == "cudagraphs" else loss)
            step += 1
            on_step(step, loss)
        _synchronize(device)
        epoch_seconds.append(timeit.default_timer() - start)
        losses += torch.stack(losses_on_device).float().tolist()  # one transfer per epoch, not per step
    model.eval()
    with torch.no_grad(), autocast:  # batch losses weighted by their sizes (the last batch may be short)
        held = [model(w[:, :-1], w[:, 1:]).float() * len(w) for w in held_out.to(device).split(settings.batch)]
    tokens_per_epoch = train.shape[0] * settings.context
    return {"kernels": kernels, "steps": step, "epoch_seconds": epoch_seconds,
            "tokens_per_s": tokens_per_epoch * len(epoch_seconds) / sum(epoch_seconds), "losses": losses,
            "held_out_loss": (torch.stack(held).sum() / len(held_out)).item(),
            "num_parameters": config.num_parameters()}  # fmt: skip


def loss_plot(path: Path, runs: Sequence[dict], title: str) -> Path:
    """Training loss per step of every kernel set on one axes, with each run's epoch time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        label = f"{run['kernels']} ({sum(run['epoch_seconds']):.1f} s, {run['tokens_per_s']:,.0f} tokens/s)"
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=120)
