"""The host (CPU memory) tier of the KV cache: which full pages it holds, and which to drop.

When the device pool runs out, the page table evicts full pages to this tier
instead of throwing their K/V away: bringing a page back later is one
host-to-device copy instead of recomputing 256 tokens through the whole model.
This class is bookkeeping only (slots keyed by the page's chained hash, with the
parent hash, the tokens and a last-used clock); the bytes live in
`kv_store.HostKVStore` at the same slot numbers, and the page table asks its
`PageMover` to copy them.

Restoring a page leaves the host copy in place: a page may live in both tiers,
and evicting it from the device again later then costs no copy. Residency counts
such a page once, at the device.

When the tier is full, a slot is dropped in the page table's order, for the same
reasons (`eviction.tier_eviction_order`): orphans first (an entry whose parent is in neither
tier can never be matched again), then whole trees by least-recently-used root,
deepest page first, so the longest prefix of each conversation survives longest.
Partial pages never come here: the page table drops them on eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from kvchat.engine.cache.eviction import tier_eviction_order
from kvchat.engine.cache.page_hash import page_hash


@dataclass(frozen=True)
class HostPage:
    """A read-only view of one host slot, for the page table and for tests."""

    hash: bytes
    slot: int
    parent: bytes
    tokens: tuple[int, ...]
    last_used: int


@dataclass
class _Entry:
    slot: int
    parent: bytes
    tokens: tuple[int, ...]
    last_used: int


class HostTier:
    """Slots of host memory holding evicted full pages, looked up by page hash."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._entries: dict[bytes, _Entry] = {}
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self.dropped = 0  # entries dropped to make room (the `host_dropped` counter)

    # ---- lookups -------------------------------------------------------------------------

    def __contains__(self, page_hash_: object) -> bool:
        return page_hash_ in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slot_of(self, page_hash_: bytes) -> int | None:
        """The slot holding this page's K/V, or None when the page is not on the host."""
        entry = self._entries.get(page_hash_)
        return None if entry is None else entry.slot

    def get(self, page_hash_: bytes) -> HostPage | None:
        entry = self._entries.get(page_hash_)
        if entry is None:
            return None
        return HostPage(page_hash_, entry.slot, entry.parent, entry.tokens, entry.last_used)

    def parent_of(self, page_hash_: bytes) -> bytes | None:
        entry = self._entries.get(page_hash_)
        return None if entry is None else entry.parent

    def last_used(self, page_hash_: bytes) -> int:
        return self._entries[page_hash_].last_used

    def pages(self) -> Iterator[HostPage]:
        """Every held page, in no particular order."""
        for h, e in self._entries.items():
            yield HostPage(h, e.slot, e.parent, e.tokens, e.last_used)

    # ---- changes -------------------------------------------------------------------------

    def touch(self, page_hash_: bytes, clock: int) -> None:
        """Mark a page used at `clock` (never moves the clock backwards)."""
        entry = self._entries[page_hash_]
        entry.last_used = max(entry.last_used, clock)

    def put(
        self,
        page_hash_: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        clock: int,
        *,
        anchored: Callable[[bytes], bool],
        protect: Collection[bytes] = (),
        before_drop: Callable[[bytes, int], None] | None = None,
    ) -> int | None:
        """Take a page that is not yet here; return its slot, or None if no slot can be freed.

        `anchored(h)` says whether a hash outside this tier still leads to the root
        (it is the root salt, or a page indexed on the device): entries whose chain
        ends elsewhere are orphans and go first. `protect` are hashes that must not
        be dropped now (the page table is about to restore them). `before_drop(h, slot)`
        runs before a victim's slot is reused (the disk tier keeps a copy then).
        """
        if page_hash_ in self._entries:
            raise ValueError("page is already on the host tier; touch it instead")
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            victim = next(iter(self.eviction_order(anchored, protect)), None)
            if victim is None:
                return None
            if before_drop is not None:
                before_drop(victim, self._entries[victim].slot)
            slot = self._entries.pop(victim).slot
            self.dropped += 1
        self._entries[page_hash_] = _Entry(slot, parent, tokens, clock)
        return slot

    def eviction_order(
        self, anchored: Callable[[bytes], bool], protect: Collection[bytes] = ()
    ) -> list[bytes]:
        """Droppable hashes, first victim first: orphans, then trees by LRU root, deepest first.

        A scan over all entries (a few hundred to a few thousand); called once per
        dropped slot, which is rare next to the copy it pays for.
        """
        entries = self._entries
        return tier_eviction_order(
            entries, lambda outside, _top: anchored(outside), protect, lambda h: entries[h].slot
        )

    def remove(self, page_hash_: bytes) -> None:
        """Forget a page (its slot becomes free). Not counted as a drop."""
        entry = self._entries.pop(page_hash_)
        heapq.heappush(self._free, entry.slot)

    # ---- checking ------------------------------------------------------------------------

    def problems(self, page_size: int) -> list[str]:
        """Every broken invariant of this tier, as precise messages (empty when sound)."""
        out: list[str] = []
        free = set(self._free)
        if len(free) != len(self._free):
            out.append("host: a slot is on the free list twice")
        used: dict[int, bytes] = {}
        for h, e in self._entries.items():
            if not 0 <= e.slot < self.num_slots:
                out.append(f"host: slot {e.slot} out of range")
            if e.slot in used:
                out.append(f"host: slot {e.slot} holds two pages")
            used[e.slot] = h
            if e.slot in free:
                out.append(f"host: slot {e.slot} is both free and holding a page")
            if len(e.tokens) != page_size:
                out.append(f"host: slot {e.slot} holds {len(e.tokens)} tokens, not {page_size}")
            if page_hash(e.parent, e.tokens) != h:
                out.append(f"host: slot {e.slot} is keyed by a hash that its tokens do not give")
        if len(used) + len(free) != self.num_slots:
            out.append(
                f"host: {len(used)} used + {len(free)} free slots != capacity {self.num_slots}"
            )
        if self.dropped < 0:
            out.append("host: negative drop counter")
        return out
