"""Defragmenting the page table when idle: cached trees packed as consecutive runs.

Contiguous chains make each sequence's pages ascending runs, which attention
reads in place instead of gathering them (benchmarks/defrag.py). Trees are laid
out from page 0, longest chain first, each depth first with its tallest child
right after its parent; each tree is followed by a few free pages when the pool
has room, so a conversation's next turn extends its run instead of landing
elsewhere (see `FreePages.take_run`). The page table decides when to run it (no
live sequence) and does the bookkeeping of each move.
"""

from __future__ import annotations

from collections.abc import Callable

from kvchat.engine.cache.page_records import Page
from kvchat.engine.cache.prefix_index import PrefixIndex

# Free pages left after each cached tree by `defragment` (when the pool has room): room for
# a conversation's next turn (a user message and a reply) to extend its run in place.
DEFRAG_GAP_PAGES = 2


def defrag_layout(cached: set[int], pages: list[Page], index: PrefixIndex) -> list[list[Page]]:
    """Cached pages in target order, per tree: trees longest chain first, each depth first."""
    kids: dict[int, list[int]] = {}
    roots: list[int] = []
    for p in cached:
        page = pages[p]
        assert page.parent is not None
        parent = index.get(page.parent)
        if parent is not None and parent in cached:
            kids.setdefault(parent, []).append(p)
        else:
            roots.append(p)
    height: dict[int, int] = {}

    def measure(root: int) -> None:  # iterative post-order: chains can be long
        stack = [(root, False)]
        while stack:
            p, done = stack.pop()
            if done:
                height[p] = 1 + max((height[k] for k in kids.get(p, ())), default=0)
            else:
                stack.append((p, True))
                stack.extend((k, False) for k in kids.get(p, ()))

    for r in roots:
        measure(r)
    trees: list[list[Page]] = []
    for r in sorted(roots, key=lambda r: (-height[r], r)):
        order: list[Page] = []
        trees.append(order)
        stack = [r]
        while stack:
            p = stack.pop()
            order.append(pages[p])
            # push the tallest child last so it is laid out right after its parent
            stack.extend(sorted(kids.get(p, ()), key=lambda k: (height[k], -k)))
    return trees


def defrag_targets(trees: list[list[Page]], num_pages: int) -> list[tuple[int, Page]]:
    """Each cached page's target index: trees in order, a gap of free pages after each."""
    cached = sum(len(t) for t in trees)
    spare_pages = num_pages - cached
    gap = min(DEFRAG_GAP_PAGES, spare_pages // len(trees)) if trees else 0
    targets: list[tuple[int, Page]] = []
    t = 0
    for tree in trees:
        for page in tree:
            targets.append((t, page))
            t += 1
        t += gap
    return targets


def move_into_place(
    targets: list[tuple[int, Page]],
    pages: list[Page],
    free: set[int],
    limit: int,
    move: Callable[[int, int], None],
) -> int:
    """Move pages to their targets, at most `limit` moves; returns how many were made.

    `move(src, dst)` moves one page's K/V and bookkeeping to a free page; `free` is
    kept up to date here. A target held by a page that belongs elsewhere is first
    parked on the highest free page.
    """
    moves = 0
    for t, page in targets:
        if page.index == t:
            continue
        if pages[t].tokens:  # occupied by a page that belongs elsewhere: park it
            spare = max((f for f in free if f != t), default=None)
            if spare is None or moves + 2 > limit:
                break
            _move(t, spare, free, move)
            moves += 1
        if moves + 1 > limit:
            break
        _move(page.index, t, free, move)
        moves += 1
    return moves


def _move(src: int, dst: int, free: set[int], move: Callable[[int, int], None]) -> None:
    move(src, dst)
    free.discard(dst)
    free.add(src)
