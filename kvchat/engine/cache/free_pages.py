"""The page table's allocator: the free device pages, handed out as consecutive runs.

A sequence whose pages are consecutive is a plain slice of the store, which
attention reads in place; scattered pages must be gathered (copied) every step
(benchmarks/defrag.py). So free pages are taken as one ascending run whenever one
exists, and otherwise lowest first (a heap), which keeps the pool packed.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class FreePages:
    """The free device pages: a heap, lowest page first."""

    def __init__(self, pages: Iterable[int]) -> None:
        self._heap = list(pages)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def pages(self) -> list[int]:
        """The free pages as stored (a page listed twice would be a bug; the checker looks)."""
        return list(self._heap)

    def pop_lowest(self) -> int:
        return heapq.heappop(self._heap)

    def push(self, p: int) -> None:
        heapq.heappush(self._heap, p)

    def replace(self, pages: Iterable[int]) -> None:
        """Make exactly `pages` the free ones (after defragmentation moved pages around)."""
        self._heap = sorted(pages)  # a sorted list is a valid heap

    def take_run(self, n: int, after: int | None) -> list[int]:
        """Remove and return `n` consecutive free pages, or none if no such run exists.

        Right after `after` when those pages are free (the sequence stays one run).
        Otherwise in the middle of the largest free run: a sequence grows forward, so
        the free pages left after it let it keep growing in place, and the pages left
        before it serve the next sequence the same way. Packing sequences at the lowest
        run instead makes every one that grows past its page jump elsewhere and be
        gathered (copied) at every decode step from then on.
        """
        if n <= 0 or len(self._heap) < n:
            return []
        free = set(self._heap)
        start: int | None = None
        if after is not None and all(after + 1 + i in free for i in range(n)):
            start = after + 1
        else:
            best_start, best_len = 0, 0
            run_start, run_len, prev = 0, 0, -2
            for p in sorted(free):
                run_start, run_len = (run_start, run_len + 1) if p == prev + 1 else (p, 1)
                prev = p
                if run_len > best_len:
                    best_start, best_len = run_start, run_len
            if best_len >= n:
                start = best_start + (best_len - n) // 2
        if start is None:
            return []
        self._heap = [p for p in self._heap if not start <= p < start + n]
        heapq.heapify(self._heap)
        return list(range(start, start + n))
