"""The one error class for a user's mistake: a bad option value, options that contradict each
other, input that does not fit them. Commands print its message as one sentence, exit with status
2 and never show a traceback for it."""


class UserError(Exception):
    """A mistake in how fastlm was called, or input it cannot use; the message is one sentence."""


def is_out_of_memory(error: BaseException) -> bool:
    """True for the allocator's OutOfMemoryError, for library calls (cuBLAS workspaces, NCCL
    buffers) that report running out of device memory as a plain RuntimeError, and for the CPU
    allocator's failure (a RuntimeError too)."""
    import torch  # loaded already wherever such an error was raised; this module stays torch-free

    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError)
        and any(text in str(error) for text in ("out of memory", "can't allocate memory"))
    )
