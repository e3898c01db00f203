"""Capture the code torch.compile generates, through PyTorch's own output-code logging.

`torch._logging.set_logs(output_code=True)` makes inductor log every generated module (Triton
kernels on CUDA, C++ on CPU) to the ``torch._inductor`` logger tree; we attach a handler there
for the duration of one compile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compiled_output_code(fn: Callable[[], object]) -> str:
    """Run ``fn`` (which calls a freshly compiled function) and return the code inductor wrote."""
    collector = _Collect()
    logger = logging.getLogger("torch._inductor")
    torch._logging.set_logs(output_code=True)
    # set_logs also prints the code to stderr: detach its handlers while we collect
    console_handlers = [(lg, h) for lg in (logging.getLogger("torch"), logger) for h in lg.handlers]
    for owner, handler in console_handlers:
        owner.removeHandler(handler)
    logger.addHandler(collector)
    try:
        fn()
    finally:
        logger.removeHandler(collector)
        for owner, handler in console_handlers:
            owner.addHandler(handler)
        torch._logging.set_logs()
    return "\n\n".join(m for m in collector.messages if "def " in m or "kernel" in m)


def compiled_cross_entropy_code(device: torch.device, batch: int = 4096, vocab: int = 32000) -> str:
    """Generated code of eager cross-entropy (bf16 logits, reduction='none'), forward and backward."""
    torch._dynamo.reset()  # make sure this compile is fresh, so its code is logged
    logits = torch.randn(batch, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (batch,), device=device)
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t, reduction="none"))
    return compiled_output_code(lambda: compiled(logits, targets).sum().backward())


def write_compiled_cross_entropy(path: Path, device: torch.device) -> Path:
    code = compiled_cross_entropy_code(device)
    if not code:
        raise RuntimeError("torch.compile logged no output code; this PyTorch may name its loggers differently")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(code)
    return path
