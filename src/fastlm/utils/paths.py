"""Output folders checked before any work starts, so a path that cannot be written is one sentence
at the start of a command rather than a traceback after minutes of work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable_folder(path: Path) -> None:
    """Raise ValueError, one sentence naming ``path``, unless it is a folder this process can write
    into or create. A folder is made and removed in its nearest existing ancestor to find out:
    permission bits do not tell for root, nor on file systems such as /proc."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        if existing == path:
            raise ValueError(f"{path} is a file, not a folder")
        raise ValueError(f"{path} cannot be a folder: {existing} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".fastlm-"))
    except OSError as error:
        raise ValueError(f"{path} cannot be written: making a folder in {existing} fails ({error.strerror})") from None
