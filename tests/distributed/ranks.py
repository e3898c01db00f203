"""Two gloo ranks kept alive across tests: ``run(body, *args)`` calls ``body(rank, *args)`` on each.

Starting the processes of `fastlm.distributed.launch.spawn` costs seconds per test (each imports
torch, fastlm and the test module); the tests of what the wrappers and optimizers compute need
ranks in one process group, not new processes. Each body starts from the generator seed a new
process has, and ends in a barrier, as under `spawn`. A failing rank fails the test with its
traceback and takes the processes down (the other rank may wait in a collective); the next test
starts new ones. Tests of launching and of processes that die keep `spawn`.

A body that changes module state (a module attribute, a patched function) restores it itself.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastlm.distributed.launch import exit_process, free_port

WORLD = 2
TIMEOUT_S = 120.0  # a collective that waits longer fails; a test gets this long past it


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    seed = torch.initial_seed()
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError):  # the test process is gone
            task = None
        if task is None:
            break
        body, args = task
        torch.manual_seed(seed)
        try:
            body(rank, *args)
            dist.barrier()  # no rank reports before the other's collectives are done
        except BaseException:
            results.put((rank, traceback.format_exc()))
            results.close()
            results.join_thread()  # the report is written before the process ends
            exit_process(1)  # the process group may hold a collective the other rank never joins
        results.put((rank, None))
    dist.destroy_process_group()
    exit_process(0)


class Ranks:
    def __init__(self, world: int = WORLD) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self.tasks = [context.SimpleQueue() for _ in range(world)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(target=_serve, args=(rank, world, port, self.tasks[rank], self.results), daemon=True)
            for rank in range(world)
        ]
        for process in self.processes:
            process.start()

    def run(self, body: Callable, *args) -> None:
        for tasks in self.tasks:
            tasks.put((body, args))
        deadline, finished = time.monotonic() + 2 * TIMEOUT_S, 0
        while finished < self.world:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                died = [rank for rank, p in enumerate(self.processes) if not p.is_alive()]
                if died or time.monotonic() > deadline:
                    self.stop(kill=True)
                    why = f"rank {died[0]} ended without a word" if died else f"no result in {2 * TIMEOUT_S:.0f} s"
                    raise AssertionError(f"{body.__name__}: {why}") from None
                continue
            if error is not None:
                self.stop(kill=True)
                raise AssertionError(f"{body.__name__} failed on rank {rank}:\n{error}")
            finished += 1

    def stop(self, kill: bool = False) -> None:
        for process, tasks in zip(self.processes, self.tasks, strict=False):
            if kill:
                process.kill()
            elif process.is_alive():
                tasks.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []


_ranks: Ranks | None = None


def run(body: Callable, *args) -> None:
    """``body(rank, *args)`` on each of WORLD ranks of one gloo process group; raises if any rank
    fails. ``body`` and ``args`` must be picklable (module-level functions)."""
    global _ranks
    if _ranks is None or not all(p.is_alive() for p in _ranks.processes):
        _ranks = Ranks()
    try:
        _ranks.run(body, *args)
    except BaseException:
        _ranks.stop(kill=True)  # a rank may still be inside the body: the next test starts new ones
        _ranks = None
        raise


@atexit.register
def _stop() -> None:
    if _ranks is not None:
        _ranks.stop()
