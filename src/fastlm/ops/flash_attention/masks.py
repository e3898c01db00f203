"""Which keys a query sees: the causal flag and the sliding window, as bounds on key positions.

Query row i of M sits at position p = i + (N - M) among N keys: aligned bottom-right, as in
FlashAttention-2 (for M == N, p = i). With ``window = (left, right)`` it sees key j iff
p - left <= j <= p + right; -1 leaves a side unbounded, and ``causal`` bounds the right side at 0
(j <= p). No window and no causal flag: every key. In packed sequences the same holds inside each
document, with M and N the document's lengths.
"""

from __future__ import annotations

import torch

from fastlm.ops.common import check_integer

UNBOUNDED = (-1, -1)  # no window: every key on either side


def check_window(window) -> tuple[int, int]:
    """``window`` checked, as a (left, right) tuple of ints: None is (-1, -1); each side an int >= 0,
    or -1 for no limit on that side (as FlashAttention's ``window_size``)."""
    if window is None:
        return UNBOUNDED
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, got {window!r}")
    left, right = check_integer("window's left", window[0]), check_integer("window's right", window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be ints >= 0, or -1 for no limit, got (left, right) = ({left}, {right})")
    return left, right


def window_bounds(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) bounds of a checked ``window`` under ``causal`` (right bound 0); -1 is unbounded."""
    left, right = window
    return left, 0 if causal else right


def visible(positions: torch.Tensor, keys: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """(..., rows, keys) bool: the query at key position ``positions[..., r]`` sees key ``keys[..., c]``,
    for bounds (left, right) from `window_bounds`; leading dims (tiles of packed rows) broadcast."""
    offset = keys[..., None, :] - positions[..., :, None]  # j - p
    seen = offset >= -left if left >= 0 else torch.ones_like(offset, dtype=torch.bool)
    return seen & (offset <= right) if right >= 0 else seen
