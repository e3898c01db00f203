"""Document boundaries of packed rows, as the model's attention takes them.

Prepared data holds the tokenizer's boundary id before every document (`fastlm data prepare`) and
nowhere else, so in a row of tokens a document starts at the row's first token and at every
boundary id. `cu_seqlens` turns a batch of rows into FlashAttention's cumulative lengths over the
rows laid end to end, on the host, from the window the loader already holds: no device work, no
wait. The count of documents is padded with empty ones (repeats of the total) to a power of two,
so that a compiled model meets few distinct shapes (one per power of two) instead of one per batch.
"""

from __future__ import annotations

import numpy as np

MIN_DOCUMENTS = 64  # the smallest padded count: real text rarely packs more documents into a batch


def cu_seqlens(tokens: np.ndarray, boundary: int) -> np.ndarray:
    """tokens (B, N) -> int32 (S + 1,): 0, the start of every document after the first, B N, then
    B N repeated up to S = max(MIN_DOCUMENTS, the next power of two of the document count)."""
    batch, length = tokens.shape
    starts = tokens == boundary
    starts[:, 0] = True  # every row starts a document, whatever its first token
    bounds = np.append(np.flatnonzero(starts), batch * length)
    documents = max(MIN_DOCUMENTS, 1 << (len(bounds) - 2).bit_length())
    padded = np.full(documents + 1, batch * length, dtype=np.int32)
    padded[: len(bounds)] = bounds
    return padded
