"""Run a function on several local processes joined in one process group (benchmarks and tests),
and end a worker process cleanly.

`torchrun` is the launcher for training; benchmarks that sweep several world sizes from one command
start their own processes instead: one per rank with torch.multiprocessing, a rendezvous on a free
localhost port, gloo on CPU or NCCL with GPU `rank` per process.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_process(code: int = 0) -> NoReturn:
    """End a worker process whose work is done: flush its output and skip interpreter teardown.
    Gloo's background threads can abort a process that finalizes after its process group is gone
    (SIGABRT, "terminate called without an active exception"), failing a finished run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(rank: int, world: int, backend: str, port: int, timeout_s: float, body: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        body(rank, *args)
        # no rank tears down while another still has collectives in flight (on GPUs: on its own)
        dist.barrier(device_ids=[rank] if backend == "nccl" else None)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # reached only when the body succeeded; failures propagate to mp.spawn


def spawn(body: Callable, world: int, *args, backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """Call ``body(rank, *args)`` on ``world`` new processes inside an initialized process group;
    raises if any rank fails. ``body`` and ``args`` must be picklable (module-level functions)."""
    mp.spawn(_run, args=(world, backend, free_port(), timeout_s, body, args), nprocs=world, join=True)
