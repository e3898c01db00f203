"""Learning-rate schedule: linear warmup, then cosine decay to a floor (GPT-3, nanoGPT, Chinchilla).

    step:  0 ........ warmup ........................................ steps
    lr:    lr/(warmup+1) -> lr -> cosine ----------------------------> min_lr

Steps count from 0 (the first optimizer step). During warmup the rate grows linearly, reaching
``lr`` at the step ``warmup``; from there it follows half a cosine from ``lr`` down towards
``min_lr``, which it would reach at step ``steps``. ``warmup = 0`` starts at ``lr``; ``min_lr = lr``
makes the rate constant after warmup.
"""

from __future__ import annotations

import math


def warmup_cosine_lr(step: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of a run of ``steps`` steps."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(steps - warmup, 1)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (lr - min_lr)
