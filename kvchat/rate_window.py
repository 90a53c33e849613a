"""Rates over a sliding window of timed counts: the engine's tokens a second, a remote
engine's, and a streaming reply's in the TUI.

Why one class: each of those kept its own deque and divided by a different span (the
window's full length, or the time since the window's first entry), so figures shown
side by side disagreed. A meter read "all 2 tok/s" beside "this reply 99 tok/s" while
the only reply streamed: the engine's window still held the prompt's prefill steps,
and their seconds counted against the decode tokens that followed.

Here each kind of count has its own span: from the start of the first entry in the
window that counted any of it, to now. An entry may carry the time its work started
(an engine step); without one (a token's arrival) the first entry only marks the
start, and its own count is left out, so one entry alone gives no rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class _Entry:
    started: float | None
    ended: float
    counts: tuple[int, ...]


class RateWindow:
    """Counts of one or more kinds (`kinds`), each entry timed; rates a second over the
    last `seconds`. Not thread-safe: callers hold their own lock."""

    def __init__(self, seconds: float, kinds: int = 1) -> None:
        self.seconds = seconds
        self.kinds = kinds
        self._entries: deque[_Entry] = deque()

    def add(self, now: float, *counts: int, started: float | None = None) -> None:
        """Counts of work that ended at `now` (and began at `started`, when known)."""
        if len(counts) != self.kinds:
            raise ValueError(f"{self.kinds} counts expected, got {len(counts)}")
        self._entries.append(_Entry(started, now, counts))
        self._forget(now)

    def add_to_last(self, kind: int, count: int) -> None:
        """More of `kind` for the newest entry (work that the same step did)."""
        last = self._entries[-1]
        counts = list(last.counts)
        counts[kind] += count
        self._entries[-1] = _Entry(last.started, last.ended, tuple(counts))

    def rate(self, now: float, kind: int = 0) -> float | None:
        """`kind` a second, from when the window's first work of that kind began; None
        when the window holds too little of it to say."""
        self._forget(now)
        total = 0
        start: float | None = None
        for entry in self._entries:
            count = entry.counts[kind]
            if start is None:
                if not count:
                    continue
                if entry.started is None:
                    start = entry.ended  # an arrival: it marks the start, its count is before
                    continue
                start = entry.started
            total += count
        if start is None or total == 0 or now <= start:
            return None
        return total / (now - start)

    def _forget(self, now: float) -> None:
        while self._entries and self._entries[0].ended < now - self.seconds:
            self._entries.popleft()
