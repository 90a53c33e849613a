"""Giving the heap's free memory back to the OS once a burst of long steps is over.

A long step (a new prompt, a history recomputed: hundreds to thousands of rows) allocates
activations of many MiB and frees them at its end. glibc keeps freed blocks in its arenas
for reuse and returns a page to the OS only from the top of an arena, so once a smaller
allocation lands above them the pages stay resident: from turn 100 to 300 of the soak the
heap's free part grew from 48 to 125 MiB. `malloc_trim(0)` returns every whole free page
of every arena (a few milliseconds).

It runs once a burst of long steps is over (the next step is short, or the engine has
nothing to do), not after each long step: the steps of a burst reuse each other's
buffers, and a trim between them would make the next one fault its pages in again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvchat.malloc_trim import glibc_malloc_trim

log = logging.getLogger(__name__)

# Steps of this many rows or more leave enough freed memory behind to be worth a trim.
LONG_STEP_ROWS = 256


class HeapTrim:
    """Whether a long step ran since the last trim, and the trim to run when it is over."""

    def __init__(self, trim: Callable[[], None] | None = None) -> None:
        self._trim = trim if trim is not None else glibc_malloc_trim()
        self._owed = False
        self.trims = 0

    def after_step(self, rows: int) -> None:
        """A step of `rows` rows ran: a long one makes a trim owed, a short one pays it."""
        if rows >= LONG_STEP_ROWS:
            self._owed = True
        elif self._owed:
            self._release()

    def at_idle(self) -> None:
        """The engine has nothing to run: pay a trim that is owed."""
        if self._owed:
            self._release()

    def _release(self) -> None:
        self._owed = False
        if self._trim is None:
            return
        try:
            self._trim()
        except OSError:  # never fail a step over memory that could not be handed back
            log.warning("malloc_trim failed", exc_info=True)
            return
        self.trims += 1
