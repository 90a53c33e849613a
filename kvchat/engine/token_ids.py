"""Helpers over token id sequences that every layer shares (no torch)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a whole tail matches) in one C-level comparison
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
