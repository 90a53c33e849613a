"""What admitting a sequence takes, decided before the page table changes anything.

`PageTable.reserve` is two halves: this plan (walk the sequence's full pages by
chained hash, check that the pages it needs can be had, read the disk tier's pages),
then one loop over the walk with one case per page. Why read disk pages here: a page
file can fail its checks, and the disk tier then removes it; finding that out before
any page is pinned or allocated means the walk can simply be made again (it now ends
before that page), with nothing to undo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvchat.engine.cache.lower_tiers import LowerTiers
from kvchat.engine.cache.prefix_index import PrefixIndex, PrefixMatch


@dataclass(frozen=True)
class Admission:
    """The walk of one sequence and what admitting it takes."""

    walk: PrefixMatch  # its full pages by chained hash, and the tail to reuse
    device_hits: list[int]  # the walk's pages already on the device
    takeover: bool  # extend the cached partial tail page in place
    fresh: int  # device pages to allocate
    from_disk: dict[bytes, Any]  # the walk's pages only the disk holds, already read

    @property
    def lower(self) -> list[bytes]:
        """The walk's pages to restore from the host or disk tier."""
        return [h for h, p in self.walk.chain if p is None]

    @property
    def after(self) -> int | None:
        """The page new pages should follow: the tail page extended in place, else the last
        device hit when the walk's pages all are (a restored page lands elsewhere)."""
        if self.takeover:
            return self.walk.tail_src
        return self.device_hits[-1] if self.device_hits and not self.lower else None

    @property
    def protect_host(self) -> set[bytes]:
        """Host pages that making room must not drop: they are about to be restored."""
        tail = self.walk.tail_host
        return set(self.lower) if tail is None else {*self.lower, tail}


def plan_admission(
    tokens: tuple[int, ...],
    is_type_ahead: bool,
    *,
    salt: bytes,
    index: PrefixIndex,
    tiers: LowerTiers,
    can_allocate: Callable[[int, set[int]], bool],
    can_take_over: Callable[[int, int], bool],
    window_cut: Callable[[PrefixMatch, dict[bytes, Any]], int] | None = None,
) -> Admission | None:
    """The walk of `tokens` and what admitting it takes; None if it cannot fit.

    At most `len(tokens) - 1` tokens are matched: the last one is always computed, for
    its logits. When the pages do not fit with the tail kept, the tail copy is given up
    to make room. Changes nothing but the disk tier (a page that fails its checks).
    `window_cut` (a model with windowed layers kept apart) says how much of a walk can
    be started from (`PageTable._window_cut`); the walk is made again up to there.
    """
    n, ps = len(tokens), index.page_size
    # ceil((n + 1) / ps): the prompt plus one generated token; a type-ahead generates none
    total_pages = -(-n // ps) if is_type_ahead else n // ps + 1
    limit = n - 1
    while True:
        walk = index.walk(tokens, limit, salt, tiers.host, host_tail=True, disk=tiers.disk)
        device_hits = [p for _, p in walk.chain if p is not None]
        need = total_pages - len(device_hits)
        pinned = set(device_hits)
        tail = walk.tail_src
        takeover = tail is not None and can_take_over(tail, walk.tail_len)
        if not can_allocate(need - int(takeover), pinned if tail is None else pinned | {tail}):
            if tail is None or not can_allocate(need, pinned):
                return None
            walk.tail_src, walk.tail_len = None, 0  # make room by giving up the tail copy
            takeover = False
        from_disk = tiers.read_disk_only([h for h, p in walk.chain if p is None])
        if from_disk is not None and window_cut is not None:
            start = window_cut(walk, from_disk)
            if start < len(walk.chain) * ps + walk.tail_len:
                limit = start
                continue
        if from_disk is not None:
            return Admission(walk, device_hits, takeover, need - int(takeover), from_disk)
