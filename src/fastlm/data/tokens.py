"""Reading prepared token data (`fastlm data prepare`): splits as memory-mapped arrays, cut into
windows, and the order in which training visits them.

A split (a list of token ranges of shard files) is cut into windows of context + 1 tokens, the
inputs and next-token targets of one sequence: window j of a range covers its tokens
[j * context, (j + 1) * context], so consecutive windows share one token and every token is a
target once. Training visits the windows in epochs, each a permutation of all windows drawn from
(seed, epoch); the data position of a run is how many windows it has consumed. The windows at
positions [p, p + n) depend on nothing else: not on the number of processes, nor on how the run
was interrupted and resumed. Opening the data checks every shard against the manifest (its size and
a sample of its bytes, `fastlm.data.manifest`); every window read is checked to hold token ids of
the vocabulary only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastlm.data.manifest import DataError, check_shard, read_manifest


class TokenData:
    """Prepared data in ``directory``: its manifest's fields and its splits, memory-mapped."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise DataError(f"--data {directory} is not a folder of prepared data (fastlm data prepare --out)")
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise DataError(f"--data {directory} holds no prepared data (no manifest.json): run fastlm data prepare")
        self.manifest = manifest
        self.vocab_size: int = manifest["vocab_size"]
        self.tokenizer: str = manifest["tokenizer"]
        self.sha256: str = manifest["sha256"]
        self._shards = {}
        for shard in manifest["shards"]:
            check_shard(self.directory, manifest, shard)
            self._shards[shard["file"]] = np.memmap(self.directory / shard["file"], dtype=manifest["dtype"], mode="r")

    @property
    def boundary(self) -> int | None:
        """The id written before every document (the tokenizer's end-of-text), None in data that
        records none."""
        return self.manifest.get("eot")

    def split(self, name: str) -> list[np.ndarray]:
        """The token ranges of split ``name`` ("train" or "val"), views of the memory maps."""
        return [self._shards[r["file"]][r["start"] : r["stop"]] for r in self.manifest["splits"][name]]

    def windows(self, split: str, context: int) -> Windows:
        return Windows(self.split(split), context, self.vocab_size)


class Windows:
    """The windows of context + 1 tokens of a split; ``windows[ids]`` -> (len(ids), context + 1) int64,
    DataError for a window that holds an id outside [0, vocab_size)."""

    def __init__(self, ranges: list[np.ndarray], context: int, vocab_size: int) -> None:
        self.ranges, self.context, self.vocab_size = ranges, context, vocab_size
        counts = [max(len(r) - 1, 0) // context for r in ranges]
        self._first = np.cumsum([0, *counts])  # the id of each range's first window
        self.count = int(self._first[-1])

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        rows = np.empty((len(ids), self.context + 1), dtype=np.int64)
        ranges = np.searchsorted(self._first, ids, side="right") - 1
        for row, (window, index) in enumerate(zip(ids, ranges, strict=True)):
            start = (window - self._first[index]) * self.context
            rows[row] = self.ranges[index][start : start + self.context + 1]
        if len(rows) and not (rows.min() >= 0 and rows.max() < self.vocab_size):
            bad = int(rows[(rows < 0) | (rows >= self.vocab_size)][0])
            raise DataError(
                f"the data holds token id {bad}, outside its vocabulary of {self.vocab_size:,} ids: a "
                "damaged shard (fastlm data verify finds it)"
            )
        return rows


class EpochOrder:
    """Window ids in the order training visits them: epoch after epoch, each a permutation of
    range(count) drawn from (seed, epoch). One epoch's permutation (8 bytes a window) is cached."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed = count, seed
        self._epoch, self._order = -1, None

    def ids(self, position: int, n: int) -> np.ndarray:
        """The ids of the windows at data positions [position, position + n)."""
        out = np.empty(n, dtype=np.int64)
        done = 0
        while done < n:
            epoch, offset = divmod(position + done, self.count)
            take = min(n - done, self.count - offset)
            out[done : done + take] = self._permutation(epoch)[offset : offset + take]
            done += take
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.count)
            self._epoch = epoch
        return self._order
