"""What the page table hands out: a reservation, a page's read-only view, a stats snapshot.

Frozen values, so the engine, tests and the UI can keep them without seeing the table
change under them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.cache.cache_counters import CacheCounters
from kvchat.engine.cache.page_records import Page
from kvchat.engine.events import CachedTokens
from kvchat.engine.per_tier import PerTier
from kvchat.engine.stats import TierPages


@dataclass(frozen=True)
class Reservation:
    """What `reserve` found and allocated for one sequence.

    `pages` covers every prompt token plus one slot for the first generated token.
    The first `to_compute_from` tokens already have K/V in those pages; the engine
    computes the rest (always at least one token, for the last token's logits).
    """

    seq_id: int
    pages: tuple[int, ...]
    # tokens found per tier: on the device (shared/cached pages + `reused_tail`), restored
    # from the host tier, read back from the disk tier
    cached: CachedTokens
    reused_tail: int  # tokens copied from a partial (or capped full) page; part of cached.device
    to_compute_from: int  # == cached.total
    # of cached.device: tokens that type-aheads computed and no turn had used
    cached_type_ahead: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.cached.total


@dataclass(frozen=True)
class PageInfo:
    """A read-only view of one device page (for tests, debugging and the UI)."""

    index: int
    hash: bytes | None  # set once the page is full
    parent: bytes | None  # the previous page's hash (or the root salt); None while empty
    tokens: tuple[int, ...]
    refcount: int
    last_used: int
    indexed: bool  # matchable by hash (a full page computed twice keeps one copy indexed)
    # slots from here on a type-ahead computed and no turn used yet
    type_ahead_from: int | None = None

    @classmethod
    def of(cls, page: Page, *, indexed: bool) -> PageInfo:
        return cls(
            page.index,
            page.hash,
            page.parent,
            tuple(page.tokens),
            page.refcount,
            page.last_used,
            indexed,
            page.type_ahead_from,
        )


@dataclass(frozen=True)
class PageTableStats:
    """A snapshot of the page table: pages per tier and its counters."""

    pages: PerTier[TierPages]  # disk: empty here (the disk tier counts its own pages)
    counters: CacheCounters
    window: TierPages | None = None  # the windowed layers' slots, where they are apart
