"""The page table's eviction policy: which cached device page to give up first.

Eviction order, when the free list is empty:

1. Empty pages: the free list itself; nothing is lost.
2. Orphaned chains: cached pages whose parent hash is in neither tier (and
   their descendants). A lookup walks chains from the root, so these can never
   be matched again; keeping them only costs space.
3. Pages that only type-aheads computed and no turn has used yet: a type-ahead is a guess
   at a message not sent, so it goes before anything a conversation used. Among
   them, the trees' order below, deepest first (a type-ahead's chain stays a prefix).
   Pages a type-ahead found in the cache keep their place.
4. Whole trees, least-recently-used root first, deepest page first.

Why not something simpler: plain per-page LRU evicts a conversation's *first*
pages as readily as its last ones (a prefix's pages are all touched at the
same time, and the root is the oldest), and one missing page in the middle of
a chain makes every page after it unreachable: the whole history is
recomputed to save one page. Evicting leaf first keeps each surviving part a
valid prefix, so a partly evicted conversation still hits on its longest
prefix and recomputes (or restores) only its tail. Taking whole trees by the
recency of their root (touched by every request that uses the tree) finishes
one cold conversation before cutting into a warm one, instead of shaving every
conversation a little so that each misses its tail on its next turn. Orphans
go before all trees since they are pure waste.

Evicting a full indexed page copies it to the host tier (or finds it there
already); a partial page, or any page without a host tier, is dropped (the page
table does that part). Referenced pages are never victims. The host and disk
tiers drop their own entries in the same order (`tier_eviction_order`), each
looking only at its own entries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the host tier imports this module
    from kvchat.engine.cache.page_records import Page
    from kvchat.engine.cache.prefix_index import PrefixIndex
    from kvchat.engine.tiers.host_tier import HostTier


@dataclass(frozen=True)
class _Place:
    """A page's position for eviction: orphan or not, its tree's root and recency, its depth."""

    orphan: bool
    root_clock: int | None  # last use of the tree's root; None above the root (the salt)
    root: bytes  # the root's hash: keeps trees with equal clocks from interleaving
    depth: int  # pages from the root down to this one (the salt is 0)


def eviction_order(
    cached: Iterable[int],
    keep: set[int],
    pages: list[Page],
    index: PrefixIndex,
    host: HostTier | None,
    salt: bytes,
) -> list[int]:
    """The `cached` pages except `keep`, first victim first (see the module docstring)."""
    memo: dict[bytes, _Place] = {salt: _Place(False, None, b"", 0)}
    keyed: list[tuple[int, int, bytes, int, int]] = []
    for p in cached:
        if p in keep:
            continue
        page = pages[p]
        assert page.parent is not None
        above = _resolve(page.parent, memo, pages, index, host)
        depth = above.depth + 1
        # only a type-ahead's guess, or a conversation's
        rank = 1 if page.type_ahead_from == 0 else 2
        if above.orphan:
            keyed.append((0, 0, b"", -depth, p))
        elif above.root_clock is None:  # this page is its tree's root
            keyed.append((rank, page.last_used, page.hash or b"", -depth, p))
        else:
            keyed.append((rank, above.root_clock, above.root, -depth, p))
    keyed.sort()
    return [k[-1] for k in keyed]


def _resolve(
    h: bytes,
    memo: dict[bytes, _Place],
    pages: list[Page],
    index: PrefixIndex,
    host: HostTier | None,
) -> _Place:
    """Where the page named `h` sits in its tree, looked up through both tiers."""
    path: list[tuple[bytes, int]] = []
    cur = h
    while cur not in memo:
        p = index.get(cur)
        if p is not None:
            parent, used = pages[p].parent, pages[p].last_used
        elif host is not None and cur in host:
            parent, used = host.parent_of(cur), host.last_used(cur)
        else:  # the chain is broken here: every page below it is an orphan
            memo[cur] = _Place(True, None, b"", 0)
            break
        assert parent is not None
        path.append((cur, used))
        cur = parent
    place = memo[cur]
    for node, used in reversed(path):
        if place.root_clock is None and not place.orphan:  # `node` is a tree's root
            place = _Place(False, used, node, place.depth + 1)
        else:
            place = _Place(place.orphan, place.root_clock, place.root, place.depth + 1)
        memo[node] = place
    return memo[h]


class TierEntry(Protocol):
    """What the order needs of an entry of a lower tier (host slots, disk files)."""

    @property
    def parent(self) -> bytes: ...

    @property
    def last_used(self) -> float: ...


def tier_eviction_order(
    entries: Mapping[bytes, TierEntry],
    anchored: Callable[[bytes, bytes], bool],
    protect: Collection[bytes] = (),
    tiebreak: Callable[[bytes], int] | None = None,
) -> list[bytes]:
    """One tier's droppable hashes, first victim first: orphans, then trees by LRU root,
    deepest first (the module docstring says why).

    A chain whose top entry `top` has a parent `outside` that this tier does not hold
    still leads to the root when `anchored(outside, top)`; otherwise its entries are
    orphans. `protect` are never returned; `tiebreak` orders entries the rest leaves
    equal. A scan over all entries, called once per drop.
    """
    # memo: hash -> (orphan, its tree root's clock, the root's hash, depth within this tier)
    memo: dict[bytes, tuple[bool, float, bytes, int]] = {}
    keyed: list[tuple[int, float, bytes, int, int, bytes]] = []
    for h in entries:
        orphan, root_clock, root, depth = _resolve_in_tier(h, entries, anchored, memo)
        if h in protect:
            continue
        tie = tiebreak(h) if tiebreak is not None else 0
        if orphan:
            keyed.append((0, 0, b"", -depth, tie, h))
        else:  # the root's hash keeps trees with equal clocks from interleaving
            keyed.append((1, root_clock, root, -depth, tie, h))
    keyed.sort()
    return [k[-1] for k in keyed]


def _resolve_in_tier(
    h: bytes,
    entries: Mapping[bytes, TierEntry],
    anchored: Callable[[bytes, bytes], bool],
    memo: dict[bytes, tuple[bool, float, bytes, int]],
) -> tuple[bool, float, bytes, int]:
    path: list[bytes] = []
    cur = h
    while cur not in memo and cur in entries:
        path.append(cur)
        cur = entries[cur].parent
    if cur in memo:
        orphan, root_clock, root, depth = memo[cur]
    else:  # `cur` is outside this tier: the top of the path is a root if it is anchored
        root = path[-1]
        orphan = not anchored(cur, root)
        root_clock = entries[root].last_used
        depth = 0
    for node in reversed(path):
        depth += 1
        memo[node] = (orphan, root_clock, root, depth)
    return memo[h]
