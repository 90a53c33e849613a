"""Which device pages keep their windowed layers' part, and in which slot of that store.

A windowed layer's query at position q reads positions q - window + 1 to q only, so a
live sequence needs the window part of its last ceil((window - 1) / S) + 1 pages and no
other (`first_page`). A page's part is held (`ref`) by every live sequence whose window
covers it; once none does, it stays as cache, idle, until a slot is wanted and it is
the longest idle: that is how a finished conversation's last pages keep their part, so
switching back to it finds its window there. The full-attention layers of every page
stay in the page table's pool whatever happens here.

Slot 0 is never given: a page list names it where a part was let go, and the windowed
layers never read there (a window's positions all have their part).

Pure bookkeeping, no torch; the page table calls it from the step thread.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from kvchat.engine.stats import TierPages

UNKEPT = 0  # the slot a page list names for a page whose window part was let go


class WindowSlotsExhausted(RuntimeError):
    """Every window slot is held by a live sequence: the pool was sized too small."""


class WindowSlots:
    def __init__(
        self, num_slots: int, window: int, page_size: int, chunk_tokens: int, num_pages: int
    ) -> None:
        """`num_slots` slots (slot 0 included) for a window of `window` tokens, beside a pool
        of `num_pages` pages; a step writes at most `chunk_tokens` new tokens, on top of
        each sequence's window. With a slot for every page no part is ever let go."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.num_slots = num_slots
        self.window = window
        self.page_size = page_size
        self.per_sequence = -(-(window - 1) // page_size) + 2  # its window, this page, next
        self.per_step = -(-chunk_tokens // page_size) + 1
        self.unbounded = num_slots - 1 >= num_pages
        if not self.unbounded and not self.admits(2):
            raise ValueError(
                f"{num_slots} window slots hold fewer than two sequences' windows and a step"
            )
        self._free = list(range(UNKEPT + 1, num_slots))  # a heap: the lowest first
        self._slot: dict[int, int] = {}  # page -> its slot
        self._refs: dict[int, int] = {}  # page -> live sequences whose window covers it
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept, unreferenced; oldest first
        self.let_go = 0  # idle parts given up for a slot another page wanted

    # ---- queries ---------------------------------------------------------------------

    def slot(self, page: int) -> int | None:
        return self._slot.get(page)

    def has(self, page: int) -> bool:
        return page in self._slot

    def first_page(self, written: int) -> int:
        """The first page a sequence with `written` tokens' K/V will read again (its next
        query's window)."""
        return max(0, written - self.window + 1) // self.page_size

    def admits(self, live_sequences: int) -> bool:
        """Whether this many live sequences can each hold a window while a step writes."""
        need = live_sequences * self.per_sequence + self.per_step
        return self.unbounded or need <= self.num_slots - 1

    def slots_of(self, pages: Sequence[int]) -> tuple[int, ...]:
        """A page list as the windowed store reads it: each page's slot (`UNKEPT` if none)."""
        return tuple(self._slot.get(p, UNKEPT) for p in pages)

    def can_give(self) -> bool:
        return bool(self._free or self._idle)

    def has_free(self) -> bool:
        return bool(self._free)

    def usage(self) -> TierPages:
        """Slots as the meters show pages: held by a live sequence, idle, free."""
        held = len(self._slot) - len(self._idle)
        return TierPages(self.num_slots - 1, held, len(self._idle), len(self._free))

    @property
    def in_use(self) -> int:
        """Slots holding a part (referenced or idle)."""
        return len(self._slot)

    @property
    def idle(self) -> int:
        return len(self._idle)

    # ---- changes ---------------------------------------------------------------------

    def give(self, page: int) -> int:
        """A slot for `page` (which has none): a free one, else the longest idle part's."""
        assert page not in self._slot, f"page {page} already has window slot {self._slot[page]}"
        if self._free:
            slot = heapq.heappop(self._free)
        elif self._idle:
            victim, _ = self._idle.popitem(last=False)
            slot = self._slot.pop(victim)
            self.let_go += 1
        else:
            raise WindowSlotsExhausted(f"all {self.num_slots - 1} window slots are in use")
        self._slot[page] = slot
        self._idle[page] = None  # idle until referenced
        return slot

    def ref(self, page: int) -> None:
        assert page in self._slot, f"page {page} has no window part to hold"
        self._refs[page] = self._refs.get(page, 0) + 1
        self._idle.pop(page, None)

    def unref(self, page: int) -> None:
        left = self._refs[page] - 1
        if left:
            self._refs[page] = left
            return
        del self._refs[page]
        self._idle[page] = None  # the most recent

    def drop(self, page: int) -> None:
        """`page` leaves the device or is emptied: its part (if any) goes with it."""
        slot = self._slot.pop(page, None)
        if slot is None:
            return
        assert page not in self._refs, f"page {page} is dropped while a sequence reads it"
        self._idle.pop(page, None)
        heapq.heappush(self._free, slot)

    def moved(self, src: int, dst: int) -> None:
        """Defragmentation moved page `src` to `dst`: its part stays in its slot."""
        if src in self._slot:
            self._slot[dst] = self._slot.pop(src)
        if src in self._refs:
            self._refs[dst] = self._refs.pop(src)
        if src in self._idle:
            order = list(self._idle)
            self._idle = OrderedDict((dst if p == src else p, None) for p in order)

    def problems(self) -> list[str]:
        out = []
        slots = list(self._slot.values())
        if len(set(slots)) != len(slots) or UNKEPT in slots:
            out.append("a window slot is given twice, or slot 0 is given")
        if set(slots) & set(self._free) or len(slots) + len(self._free) != self.num_slots - 1:
            out.append("window slots free and given do not add up")
        if set(self._idle) & set(self._refs) or set(self._idle) | set(self._refs) != set(
            self._slot
        ):
            out.append("a kept window part is neither idle nor referenced, or both")
        return out
