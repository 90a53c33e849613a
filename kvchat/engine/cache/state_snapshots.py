"""A hybrid model's linear-layer states kept where pages of the cache end, so a
conversation can resume from a cached prefix.

A linear-attention layer's memory of a prefix is one state, not K/V per token, and a
state cannot be taken back to an earlier token. So a prefix is usable only up to a page
end where the state after it was kept: each time a sequence's step ends a page (a
prefill chunk crossing its end, or the decode that fills it), the state there is kept,
named by that page, and a later request's match is cut back to the last page with one
(`PageTable._state_cut`). It then computes only what follows that page: the tokens of
the partial page after it and the new ones.

States are large (a real model's are megabytes a layer), so at most `capacity` are
kept. Where a sequence ended (`mark_resume`: a finished turn's last full page, where its
conversation resumes) is let go last: first the states a sequence only passed by, the
least recently used first, then the resume points, the least recently used first; so a
long prompt's many page ends do not push out where other conversations stopped. A state
belongs to its page: it moves with it, and leaves the device with it (the host tier keeps
it in host memory, `LowerTiers.host_states`; a disk page file holds it in its last parts).

Pure bookkeeping: the states are opaque here (the engine's tensors); the page table
calls this from the step thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class StateSnapshots:
    def __init__(self, capacity: int, state_bytes: int) -> None:
        """At most `capacity` states, each `state_bytes` bytes (for the stats)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.state_bytes = state_bytes
        # page -> state, oldest use first: those passed by, and where sequences ended
        self._passed: OrderedDict[int, Any] = OrderedDict()
        self._resume: OrderedDict[int, Any] = OrderedDict()
        self.let_go = 0  # states given up for newer ones

    def __len__(self) -> int:
        return len(self._passed) + len(self._resume)

    def has(self, page: int) -> bool:
        return page in self._passed or page in self._resume

    def get(self, page: int) -> Any:
        """The state kept at `page`'s end (it counts as used now)."""
        kept = self._resume if page in self._resume else self._passed
        kept.move_to_end(page)
        return kept[page]

    def put(self, page: int, state: Any) -> None:
        """Keep the state at `page`'s end, letting the least recently used go if full."""
        self.drop(page)
        self._passed[page] = state
        while len(self) > self.capacity:  # never the state just kept
            (self._passed if len(self._passed) > 1 else self._resume).popitem(last=False)
            self.let_go += 1

    def mark_resume(self, page: int) -> None:
        """A sequence ended after `page`: its state is where the conversation resumes."""
        if page in self._passed:
            self._resume[page] = self._passed.pop(page)
        elif page in self._resume:
            self._resume.move_to_end(page)

    def drop(self, page: int) -> None:
        """`page` leaves the device or is emptied: its state goes with it."""
        self._passed.pop(page, None)
        self._resume.pop(page, None)

    def moved(self, src: int, dst: int) -> None:
        """Defragmentation moved page `src` to `dst`: its state follows, in the same place
        of the order of use."""
        for name in ("_passed", "_resume"):
            kept: OrderedDict[int, Any] = getattr(self, name)
            if src in kept:
                setattr(
                    self, name, OrderedDict((dst if p == src else p, s) for p, s in kept.items())
                )

    def nbytes(self) -> int:
        return len(self) * self.state_bytes
