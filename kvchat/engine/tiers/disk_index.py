"""The disk tier's index: which page files exist, their tree, their sizes, and which to drop.

Built at start-up from folder and file names alone (`<salt>/<parent>/<hash>.safetensors`)
and each file's size and modification time, without reading a tensor: the path gives
the tree, the time gives the order of last use. The folder may hold pages of several
models (one salt folder each); they share the capacity and the same eviction order.

Eviction, when a new page would pass the capacity, follows the other tiers' order
for the same reasons (`eviction.tier_eviction_order`): orphans first (an entry whose
parent is neither a root salt nor indexed can never be reached by a lookup walk),
then whole trees by least-recently-used root, deepest page first, so the longest
prefix of a conversation survives longest on disk too.

Pure bookkeeping (no I/O, not thread-safe): `DiskTier` wraps it under a lock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from kvchat.engine.cache.eviction import tier_eviction_order


@dataclass(frozen=True)
class DiskEntry:
    """One indexed page file."""

    hash: bytes
    salt: bytes
    parent: bytes
    nbytes: int
    last_used: float  # seconds since the epoch (the file's modification time)


class DiskIndex:
    """Page files by hash, with the bytes they use against a capacity."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: dict[bytes, DiskEntry] = {}
        self._per_salt: dict[bytes, int] = {}  # pages per salt, kept so stats stay O(1)

    def __contains__(self, h: object) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, h: bytes) -> DiskEntry | None:
        return self._entries.get(h)

    def entries(self) -> Iterator[DiskEntry]:
        yield from self._entries.values()

    def count(self, salt: bytes) -> int:
        """Pages of one salt (one model, dtype and KV format)."""
        return self._per_salt.get(salt, 0)

    def salts(self) -> list[bytes]:
        """The salts that have pages here (one per model, dtype and KV format)."""
        return list(self._per_salt)

    def add(self, entry: DiskEntry) -> None:
        """Index a page (replacing an entry of the same hash, e.g. one another process wrote)."""
        self.remove(entry.hash)
        self._entries[entry.hash] = entry
        self.used_bytes += entry.nbytes
        self._per_salt[entry.salt] = self._per_salt.get(entry.salt, 0) + 1

    def remove(self, h: bytes) -> DiskEntry | None:
        entry = self._entries.pop(h, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
            left = self._per_salt[entry.salt] - 1
            if left:
                self._per_salt[entry.salt] = left
            else:
                del self._per_salt[entry.salt]
        return entry

    def touch(self, h: bytes, when: float) -> None:
        """Mark a page used at `when` (never moves its time backwards)."""
        e = self._entries.get(h)
        if e is not None and when > e.last_used:
            self._entries[h] = DiskEntry(e.hash, e.salt, e.parent, e.nbytes, when)

    def victims(self, need_bytes: int, protect: Collection[bytes] = ()) -> list[bytes]:
        """Hashes to drop, first victim first, so that `need_bytes` more fit; [] if none needed.

        Returns every droppable entry when even that is not enough (the caller then
        knows the page cannot fit).
        """
        excess = self.used_bytes + need_bytes - self.capacity_bytes
        if excess <= 0:
            return []
        out: list[bytes] = []
        for h in self.eviction_order(protect):
            out.append(h)
            excess -= self._entries[h].nbytes
            if excess <= 0:
                break
        return out

    def eviction_order(self, protect: Collection[bytes] = ()) -> list[bytes]:
        """Droppable hashes, first victim first: orphans, then trees by LRU root, deepest first.

        A chain's top is a root when the parent it names is its own salt.
        """
        entries = self._entries
        return tier_eviction_order(
            entries, lambda outside, top: outside == entries[top].salt, protect
        )

    def problems(self) -> list[str]:
        """Every broken invariant of the index, as precise messages (empty when sound)."""
        out: list[str] = []
        total = 0
        per_salt: dict[bytes, int] = {}
        for h, e in self._entries.items():
            per_salt[e.salt] = per_salt.get(e.salt, 0) + 1
            if e.hash != h:
                out.append(f"disk: entry {h.hex()} names page {e.hash.hex()}")
            if e.nbytes <= 0:
                out.append(f"disk: page {h.hex()} has size {e.nbytes}")
            total += e.nbytes
        if total != self.used_bytes:
            out.append(f"disk: {self.used_bytes} bytes counted, entries add up to {total}")
        if per_salt != self._per_salt:
            out.append("disk: the pages counted per salt differ from the entries")
        return out
