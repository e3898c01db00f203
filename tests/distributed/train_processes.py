"""`python -m fastlm.train` as real processes that a test can kill: one, or one per rank with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fastlm.distributed.launch import free_port


class TrainRun:
    """The processes of one command; each rank's stdout and stderr go to ``logs/<name>.rank<r>.log``
    (files rather than pipes, so a killed run's output can still be read)."""

    def __init__(self, argv: list[str], logs: Path, name: str, world: int = 1, env: dict | None = None) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"{name}.rank{rank}.log" for rank in range(world)]
        port = str(free_port())
        self.processes = []
        for rank, log in enumerate(self.logs):
            rank_env = {**os.environ, **(env or {})}
            if world > 1:
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                )
            with log.open("w") as out:
                command = [sys.executable, "-m", "fastlm.train", *argv]
                self.processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=rank_env))

    def running(self) -> bool:
        return any(p.poll() is None for p in self.processes)

    def wait(self, timeout_s: float = 300.0) -> list[int]:
        """Every rank's exit code."""
        return [p.wait(timeout_s) for p in self.processes]

    def kill(self) -> None:
        """SIGKILL every rank that still runs (a lost machine: no handler, no cleanup), then reap them."""
        for p in self.processes:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        self.wait()

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()
