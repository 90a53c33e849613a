"""The page table's prefix index: which device page holds which chained hash, and tails.

Each full page is named by a chained hash (see `page_hash`), so one hash names a
whole prefix. The index maps a hash to the device page that answers for it; a
page computed twice at once (two sequences prefilling the same prefix) is kept as
a live duplicate, which takes over the index when the indexed copy is evicted, so
a hash held on the device is always indexed. Pages with content are also listed
under their parent hash: that is where a partial page (a previous turn's ragged
tail) is found, by the longest common prefix of its tokens.

A lookup (`walk`) matches a token list against the device index, the host tier and
the disk tier, and changes nothing; the page table decides what to take.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from kvchat.engine.cache.page_hash import page_hash
from kvchat.engine.cache.page_records import Page
from kvchat.engine.tiers.host_tier import HostTier
from kvchat.engine.token_ids import common_prefix


@dataclass
class PrefixMatch:
    """The result of matching a token list against both tiers (no state changed)."""

    # per matched full page: hash, device page or None (on the host, else on disk)
    chain: list[tuple[bytes, int | None]]
    prev: bytes  # hash after the matched chain (the tail's parent)
    tail_src: int | None  # device page to copy the tail from
    tail_host: bytes | None  # or: host page to restore partially as the tail
    tail_len: int


class PrefixIndex:
    """Hash -> device page, live duplicates, and parent hash -> pages with content under it.

    `by_hash`, `dups` and `children` are read by the page table's other parts;
    only the methods below change them.
    """

    def __init__(self, pages: list[Page], page_size: int) -> None:
        self._pages = pages  # the table's page records (the same list object)
        self.page_size = page_size
        self.by_hash: dict[bytes, int] = {}  # hash -> the indexed full page
        # hash -> live full pages computed twice (concurrently): one takes over the index
        # when the indexed page is evicted, so a hash held on the device is always indexed
        self.dups: dict[bytes, set[int]] = {}
        self.children: dict[bytes, set[int]] = {}  # parent hash -> pages with content under it

    def __contains__(self, h: bytes) -> bool:
        return h in self.by_hash

    def get(self, h: bytes) -> int | None:
        """The device page indexed under `h`, if any."""
        return self.by_hash.get(h)

    def is_indexed(self, p: int) -> bool:
        """Whether device page `p` is the one indexed under its hash."""
        h = self._pages[p].hash
        return h is not None and self.by_hash.get(h) == p

    def children_of(self, parent: bytes) -> Iterable[int]:
        return self.children.get(parent, ())

    def add_child(self, parent: bytes, p: int) -> None:
        self.children.setdefault(parent, set()).add(p)

    def add_full(self, h: bytes, p: int) -> bool:
        """Index a page that just became full; False if another page holds `h` (a duplicate)."""
        if h not in self.by_hash:
            self.by_hash[h] = p
            return True
        self.dups.setdefault(h, set()).add(p)
        return False

    def add_restored(self, h: bytes, parent: bytes, p: int) -> None:
        """Index a page copied back from the host or disk tier."""
        self.by_hash[h] = p
        self.add_child(parent, p)

    def forget(self, p: int) -> None:
        """Take page `p` out of the index (a duplicate takes over) and its parent's children."""
        page = self._pages[p]
        h = page.hash
        if h is not None and self.by_hash.get(h) == p:
            del self.by_hash[h]
            dups = self.dups.get(h)
            if dups:  # a live copy of the same page stays matchable
                self.by_hash[h] = dups.pop()
                if not dups:
                    del self.dups[h]
        elif h is not None and p in self.dups.get(h, ()):
            self.dups[h].discard(p)
            if not self.dups[h]:
                del self.dups[h]
        if page.parent is not None:
            kids = self.children[page.parent]
            kids.discard(p)
            if not kids:
                del self.children[page.parent]

    def is_dominated(self, p: int, cached: Container[int]) -> bool:
        """A partial page is useless when a kept sibling (cached, or indexed) starts with all
        of its tokens: a lookup would always match that sibling at least as far."""
        page = self._pages[p]
        assert page.parent is not None
        n = len(page.tokens)
        for q in self.children_of(page.parent):
            other = self._pages[q]
            if q == p or len(other.tokens) < n or other.tokens[:n] != page.tokens:
                continue
            if q in cached or (other.hash is not None and self.by_hash.get(other.hash) == q):
                return True
        return False

    def dominated_siblings(self, p: int, cached: Container[int]) -> list[int]:
        """Cached partial pages beside `p` whose tokens start `p`'s: `p` matches better."""
        page = self._pages[p]
        assert page.parent is not None
        out = []
        for q in self.children_of(page.parent):
            other = self._pages[q]
            n = len(other.tokens)
            if (
                q != p
                and q in cached
                and n < self.page_size
                and n <= len(page.tokens)
                and page.tokens[:n] == other.tokens
            ):
                out.append(q)
        return out

    def moved(self, page: Page, src: int, dst: int) -> None:
        """Page `page` moved from device page `src` to `dst`: repoint its entries."""
        if page.hash is not None and self.by_hash.get(page.hash) == src:
            self.by_hash[page.hash] = dst
        assert page.parent is not None
        kids = self.children[page.parent]
        kids.discard(src)
        kids.add(dst)

    def walk(
        self,
        tokens: tuple[int, ...],
        limit: int,
        salt: bytes,
        host: HostTier | None,
        *,
        host_tail: bool,
        disk: Container[bytes] | None = None,
    ) -> PrefixMatch:
        """Match `tokens` against the tiers, covering at most `limit` tokens. Changes nothing."""
        ps = self.page_size
        chain: list[tuple[bytes, int | None]] = []
        prev = salt
        capped: bytes | None = None
        i = 0
        while (i + 1) * ps <= len(tokens):
            h = page_hash(prev, tokens[i * ps : (i + 1) * ps])
            if (i + 1) * ps > limit:
                capped = h  # a full hit here would leave nothing to compute: reuse it as a tail
                break
            p = self.by_hash.get(h)
            if p is not None:
                chain.append((h, p))
            elif (host is not None and h in host) or (disk is not None and h in disk):
                chain.append((h, None))  # restorable: from the host, else read back from disk
            else:
                break
            prev = h
            i += 1
        start = i * ps
        max_m = min(ps, limit - start)
        tail_src: int | None = None
        tail_host: bytes | None = None
        best = 0
        if max_m > 0:
            want = list(tokens[start : start + max_m])
            for p in self.children.get(prev, ()):
                m = common_prefix(self._pages[p].tokens, want)
                # the longest match wins; the lowest page number breaks ties (deterministic)
                if m > best or (m == best > 0 and tail_src is not None and p < tail_src):
                    best, tail_src = m, p
            restorable = capped is not None and host is not None and capped in host
            if host_tail and best < max_m and restorable:
                best, tail_src, tail_host = max_m, None, capped
        return PrefixMatch(chain, prev, tail_src, tail_host, best)
