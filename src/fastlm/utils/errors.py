"""The one error class for a user's mistake: a bad option value, options that contradict each
other, input that does not fit them. Commands print its message as one sentence, exit with status
2 and never show a traceback for it."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path


class UserError(Exception):
    """A mistake in how fastlm was called, or input it cannot use; the message is one sentence."""


def report_error(line: str) -> None:
    """A command's one-line error on stderr; under torchrun also in the error file it reads, so that
    the "Root Cause" of its failure summary shows the line rather than a link to its docs."""
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


def is_out_of_memory(error: BaseException) -> bool:
    """True for the allocator's OutOfMemoryError, for library calls (cuBLAS workspaces, NCCL
    buffers) that report running out of device memory as a plain RuntimeError, and for the CPU
    allocator's failure (a RuntimeError too)."""
    import torch  # loaded already wherever such an error was raised; this module stays torch-free

    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError)
        and any(text in str(error) for text in ("out of memory", "can't allocate memory"))
    )
