"""The memory a run on a CPU may use, and the one-line refusal of one that would not fit in it.

On a GPU an allocation that does not fit raises, and the commands report "out of memory"; on a CPU
the operating system swaps for minutes or kills the process instead. So commands that build a
model on a CPU compare their napkin estimate with half of this host's memory first (the other half
covers what the estimates leave out: the allocator's caching, compiled code, the rest of the
machine).
"""

from __future__ import annotations

import os
from pathlib import Path

from fastlm.utils.errors import UserError


def host_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its container's limit if lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical


def host_budget() -> int:
    """Bytes a CPU run's estimate may reach: half of `host_memory`."""
    return host_memory() // 2


def check_fits_host(need: int, what: str, remedy: str) -> None:
    """UserError unless ``need`` bytes, the napkin memory of ``what`` (a phrase such as "the 10b
    preset's training step"), fit `host_budget`; ``remedy`` ends the message."""
    budget = host_budget()
    if need > budget:
        raise UserError(
            f"on a CPU, {what} needs about {need / 1e9:.1f} GB, more than half of the "
            f"{2 * budget / 1e9:.1f} GB here; {remedy}"
        )
