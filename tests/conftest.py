"""Test setup: Triton interpreter on CPU-only machines, seeded RNGs, the `gpu` marker.

TRITON_INTERPRET must be set before triton decorates any kernel, i.e. before fastlm is
imported, which is why it is set at the top of this module.
"""

import gc
import os
import random
from pathlib import Path

import pytest

if "PYTEST_XDIST_WORKER" in os.environ:
    # one worker per core (pytest_xdist_auto_num_workers): a thread pool of a core's size in each
    # would only spin against the other worker's (this process's torch and numpy, and the commands
    # and ranks a test starts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per CPU core where the kernels run through the
    interpreter, which keeps one core busy per test; none on a GPU machine, whose tests time kernels
    and size their tensors to one device's memory."""
    return 0 if _HAS_CUDA else len(os.sched_getaffinity(0))


def pytest_collection_finish(session):
    """The objects alive once the test modules are imported (torch's, triton's, transformers': some
    hundreds of thousands) leave the garbage collector's view until the session ends, so that each
    collection, the benchmarks' gc.collect() between rounds included, walks only what the tests
    made. (One of them that a test drops inside a reference cycle stays allocated until then.)"""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # so that interpreter shutdown finalizes them as usual


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    """The device the kernels are tested on: CUDA when present, else CPU through the interpreter."""
    return torch.device("cuda" if _HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def corpus_data(tmp_path_factory):
    """tests/data/corpus.txt prepared with the bytes tokenizer (about 7,600 training and 400
    held-out tokens): the folder `fastlm train --data` takes."""
    from fastlm.data.prepare import prepare

    out = tmp_path_factory.mktemp("corpus_data")
    prepare([Path(__file__).parent / "data" / "corpus.txt"], out, "bytes", held_out=0.05, shard_tokens=10**8)
    return out
