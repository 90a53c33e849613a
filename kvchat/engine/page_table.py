"""The paged KV cache's page table: which page holds which tokens, who shares it, what to evict.

A sequence's K/V lives in fixed-size device pages of `page_size` token slots.
Each full page is named by a chained hash (see `page_hash`), so one hash names a
whole prefix; pages are shared by reference count between live sequences, and a
finished sequence's pages stay indexed as the prompt cache. A new request walks
its full pages: shared or cached on the device → restored from the host tier →
computed. The ragged tail of a previous turn (a partial page) is reused by
copying its matching tokens into a fresh page, so switching back to a
conversation recomputes only what is new since its last turn; when the cached
partial page holds exactly the matched tokens, the sequence extends it in place
instead, so its pages stay one ascending run.

This module is pure bookkeeping (no torch): whenever K/V must physically move
(to the host on eviction, back on a hit, a tail copy, a defragmenting move) the
table calls its `PageMover` at once, before the page is reused, so the data
always follows the table. Costs are proportional to the pages an operation
touches (dict indexes, a free-page heap), except victim selection, which scans
the cached pages once per allocation that has to evict.

The table is not thread-safe: the engine calls it from its step thread only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvchat.engine.cache_counters import CacheCounters, PageTableStats, TierStats
from kvchat.engine.host_tier import HostTier
from kvchat.engine.page_hash import page_hash

# Free pages left after each cached tree by `defragment` (when the pool has room): room for
# a conversation's next turn (a user message and a reply) to extend its run in place.
DEFRAG_GAP_PAGES = 2


class PageTableCorrupt(AssertionError):
    """`validate()` found a broken invariant: a bug in the table, never a user error."""


class PageMover(Protocol):
    """Moves K/V bytes when the table says so; `kv_store.KVPageMover` is the real one."""

    def device_to_host(self, device_page: int, host_slot: int) -> None: ...

    def host_to_device(self, host_slot: int, device_page: int) -> None: ...

    def copy_tokens(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        """Copy the first `n_tokens` slots of `src_page` into `dst_page`."""
        ...

    def move_page(self, src_page: int, dst_page: int) -> None: ...


@dataclass(frozen=True)
class Reservation:
    """What `reserve` found and allocated for one sequence.

    `pages` covers every prompt token plus one slot for the first generated token.
    The first `to_compute_from` tokens already have K/V in those pages; the engine
    computes the rest (always at least one token, for the last token's logits).
    """

    seq_id: int
    pages: tuple[int, ...]
    cached_device: int  # tokens found on the device (shared/cached pages + `reused_tail`)
    cached_host: int  # tokens restored from the host tier
    reused_tail: int  # tokens copied from a partial (or capped full) page; part of cached_device
    to_compute_from: int  # == cached_device + cached_host

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host


@dataclass(frozen=True)
class Residency:
    """Where a token history's K/V is: on the device, only on the host, nowhere (tokens)."""

    device: int
    host: int
    nowhere: int


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


class _Page:
    """Mutable state of one device page; only the table touches it."""

    __slots__ = ("hash", "index", "last_used", "parent", "refcount", "tokens")

    def __init__(self, index: int) -> None:
        self.index = index
        self.hash: bytes | None = None
        self.parent: bytes | None = None
        self.tokens: list[int] = []  # len(tokens) is the number of filled slots
        self.refcount = 0
        self.last_used = 0


class _Seq:
    __slots__ = ("num_tokens", "pages")

    def __init__(self, pages: list[int], num_tokens: int) -> None:
        self.pages = pages
        self.num_tokens = num_tokens  # tokens whose K/V is written


@dataclass
class _Walk:
    """The result of matching a token list against both tiers (no state changed)."""

    chain: list[tuple[bytes, int | None]]  # per matched full page: hash, device page or None
    prev: bytes  # hash after the matched chain (the tail's parent)
    tail_src: int | None  # device page to copy the tail from
    tail_host: bytes | None  # or: host page to restore partially as the tail
    tail_len: int


@dataclass(frozen=True)
class _Place:
    """A page's position for eviction: orphan or not, its tree's root and recency, its depth."""

    orphan: bool
    root_clock: int | None  # last use of the tree's root; None above the root (the salt)
    root: bytes  # the root's hash: keeps trees with equal clocks from interleaving
    depth: int  # pages from the root down to this one (the salt is 0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a whole tail matches) in one C-level comparison
        return n
    i = 0
    while a[i] == b[i]:  # stops before n: the slices differ somewhere
        i += 1
    return i


class PageTable:
    """Device pages of one KV pool: allocation, prefix sharing, eviction, host tier, defrag.

    Eviction order (`_eviction_order`), when the free list is empty:

    1. Empty pages: the free list itself; nothing is lost.
    2. Orphaned chains: cached pages whose parent hash is in neither tier (and
       their descendants). A lookup walks chains from the root, so these can never
       be matched again; keeping them only costs space.
    3. Whole trees, least-recently-used root first, deepest page first.

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
    already); a partial page, or any page without a host tier, is dropped.
    Referenced pages are never victims.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        salt: bytes,
        host: HostTier | None,
        mover: PageMover,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.salt = salt
        self.host = host
        self._mover = mover
        self._pages = [_Page(i) for i in range(num_pages)]
        self._free = list(range(num_pages))  # a heap: lowest page first, so pages stay packed
        self._cached: set[int] = set()  # refcount 0, holding content
        self._index: dict[bytes, int] = {}  # hash -> the indexed full page
        # hash -> live full pages computed twice (concurrently): one takes over the index
        # when the indexed page is evicted, so a hash held on the device is always indexed
        self._dups: dict[bytes, set[int]] = {}
        self._children: dict[bytes, set[int]] = {}  # parent hash -> pages with content under it
        self._seqs: dict[int, _Seq] = {}
        self._clock = 0  # logical: one tick per operation
        self._counters = CacheCounters()

    # ---- admission -----------------------------------------------------------------------

    def reserve(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        *,
        count_as: Literal["prompt", "recompute"],
    ) -> Reservation | None:
        """Admit a sequence whose K/V must cover `token_ids`; None (no change) if it cannot fit.

        Full pages are matched by hash (shared on the device, else restored from the
        host), then the longest matching prefix of a page under the last matched
        hash is copied as the tail. At most `len(token_ids) - 1` tokens count as
        cached: the engine must compute at least the last one to get its logits.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already live")
        if count_as not in ("prompt", "recompute"):
            raise ValueError(f"count_as must be 'prompt' or 'recompute', got {count_as!r}")
        tokens = tuple(map(int, token_ids))
        n = len(tokens)
        if n == 0:
            raise ValueError("a sequence needs at least one token")
        ps = self.page_size
        walk = self._walk(tokens, n - 1, host_tail=True)
        device_hits = [p for _, p in walk.chain if p is not None]
        total_pages = n // ps + 1  # ceil((n + 1) / ps): the prompt plus one generated token
        need = total_pages - len(device_hits)
        pinned = set(device_hits)
        takeover = walk.tail_src is not None and self._can_take_over(walk.tail_src, walk.tail_len)
        if not self._can_allocate(need - int(takeover), pinned | _opt(walk.tail_src)):
            if walk.tail_src is None or not self._can_allocate(need, pinned):
                return None
            walk.tail_src, walk.tail_len = None, 0  # make room by giving up the tail copy
            takeover = False

        self._clock += 1
        clock = self._clock
        for p in device_hits:
            self._ref(p, clock)
        host_hits = [h for h, p in walk.chain if p is None]
        protect_host = set(host_hits) | _opt(walk.tail_host)
        after: int | None = device_hits[-1] if device_hits and not host_hits else None
        if takeover:
            assert walk.tail_src is not None
            self._cached.discard(walk.tail_src)  # this sequence extends it in place
            after = walk.tail_src
        fresh = self._allocate(need - int(takeover), _opt(walk.tail_src), protect_host, after=after)

        pages: list[int] = []
        it = iter(fresh)
        cached_host = 0
        parent = self.salt
        for h, p in walk.chain:
            if p is None:  # restore from the host tier
                p = next(it)
                self._restore(h, p, clock)
                self._pages[p].refcount = 1
                cached_host += ps
            pages.append(p)
            parent = h
        cached_device = len(device_hits) * ps
        reused_tail = 0
        if walk.tail_len:
            p = walk.tail_src if takeover else next(it)
            assert p is not None
            page = self._pages[p]
            m = walk.tail_len
            if takeover:
                page.last_used = clock  # already holds exactly the matched tokens
                cached_device += m
                reused_tail = m
            elif walk.tail_src is not None:
                src = self._pages[walk.tail_src]
                self._mover.copy_tokens(walk.tail_src, p, m)
                page.tokens = src.tokens[:m]
                src.last_used = clock
                cached_device += m
                reused_tail = m
            else:
                assert walk.tail_host is not None and self.host is not None
                slot = self.host.slot_of(walk.tail_host)
                assert slot is not None
                self._mover.host_to_device(slot, p)
                page.tokens = list(tokens[len(pages) * ps : len(pages) * ps + m])
                self.host.touch(walk.tail_host, clock)
                cached_host += m
            page.parent = parent
            self._children.setdefault(parent, set()).add(p)
            page.refcount = 1
            page.last_used = clock
            pages.append(p)
        for p in it:
            self._pages[p].refcount = 1
            self._pages[p].last_used = clock
            pages.append(p)

        cached = cached_device + cached_host
        self._seqs[seq_id] = _Seq(pages, cached)
        c = self._counters
        if count_as == "prompt":
            c.prompt_tokens += n
            c.cached_device += cached_device
            c.cached_host += cached_host
            c.prefilled_tokens += n - cached
        else:
            c.recomputed_tokens += n - cached
        return Reservation(seq_id, tuple(pages), cached_device, cached_host, reused_tail, cached)

    def ensure_capacity(self, seq_id: int, total_tokens: int) -> bool:
        """Give the sequence slots for `total_tokens` tokens; False (no change) if impossible."""
        seq = self._seq(seq_id)
        need = -(-total_tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if not self._can_allocate(need, set()):
            return False
        self._clock += 1
        for p in self._allocate(need, set(), set(), after=seq.pages[-1] if seq.pages else None):
            self._pages[p].refcount = 1
            self._pages[p].last_used = self._clock
            seq.pages.append(p)
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record that these tokens' K/V is now written at the sequence's next positions.

        A page that becomes full gets its hash and joins the index, unless another
        page already holds that hash (two sequences computed the same prefix at
        once): the indexed one stays, this one is freed when its sequence ends.
        """
        seq = self._seq(seq_id)
        token_ids = list(map(int, token_ids))
        ps = self.page_size
        end = seq.num_tokens + len(token_ids)
        if end > len(seq.pages) * ps:
            raise ValueError(
                f"sequence {seq_id}: committing up to {end} tokens but only "
                f"{len(seq.pages) * ps} slots are allocated (call ensure_capacity first)"
            )
        self._clock += 1
        done = 0
        while done < len(token_ids):
            pos = seq.num_tokens
            pi = pos // ps
            p = seq.pages[pi]
            page = self._pages[p]
            if not page.tokens:
                parent = self.salt if pi == 0 else self._pages[seq.pages[pi - 1]].hash
                assert parent is not None, "the previous page of a sequence is full and hashed"
                page.parent = parent
                self._children.setdefault(parent, set()).add(p)
            take = min(ps - pos % ps, len(token_ids) - done)
            page.tokens.extend(token_ids[done : done + take])
            page.last_used = self._clock
            done += take
            seq.num_tokens += take
            if len(page.tokens) == ps:
                assert page.parent is not None
                page.hash = page_hash(page.parent, page.tokens)
                if page.hash not in self._index:
                    self._index[page.hash] = p
                    self._drop_dominated_siblings(p)
                else:
                    self._dups.setdefault(page.hash, set()).add(p)

    def release(self, seq_id: int) -> None:
        """End a sequence: its full pages stay as the prompt cache, its partial page as a tail."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not live")
        self._clock += 1
        for p in reversed(seq.pages):
            page = self._pages[p]
            page.refcount -= 1
            page.last_used = self._clock
            if page.refcount == 0:
                self._settle(p)

    def rekey(self, salt: bytes) -> None:
        """Switch to another root salt (another model, dtype or KV format) keeping the pool.

        Nothing is copied or dropped now: pages under the old salt can simply never
        match again, so they become orphans, the first victims of the next eviction.
        Live sequences must have ended (their pages would chain to the old salt).
        """
        if self._seqs:
            raise ValueError("rekey needs every sequence released first")
        self.salt = salt

    def pages(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seq(seq_id).pages)

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def is_live(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def available_pages(self) -> int:
        """Pages an allocation could get now: free ones plus every evictable cached one."""
        return len(self._free) + len(self._cached)

    # ---- cache queries and upkeep --------------------------------------------------------

    def residency(self, token_ids: Sequence[int]) -> Residency:
        """Where this token history's K/V is, without changing any state (not even the clock)."""
        tokens = tuple(token_ids)
        walk = self._walk(tokens, len(tokens), host_tail=False)
        ps = self.page_size
        device = sum(ps for _, p in walk.chain if p is not None) + walk.tail_len
        host = sum(ps for _, p in walk.chain if p is None)
        return Residency(device, host, len(tokens) - device - host)

    def prefetch(self, token_ids: Sequence[int]) -> int:
        """Copy back from the host the pages of this history that only the host holds.

        They become unreferenced cached device pages, so the next `reserve` of this
        history finds them on the device. Only free pages and evictable cached pages
        of other chains are used. Returns the number of pages restored.
        """
        tokens = tuple(token_ids)
        walk = self._walk(tokens, len(tokens), host_tail=False)
        host_only = [h for h, p in walk.chain if p is None]
        if not host_only:
            return 0
        on_device = {p for _, p in walk.chain if p is not None}
        k = min(len(host_only), len(self._free) + len(self._cached - on_device))
        self._clock += 1
        for p in on_device:
            self._pages[p].last_used = self._clock
        fresh = self._allocate(k, on_device, {h for h, _ in walk.chain})
        for h, p in zip(host_only[:k], fresh, strict=True):
            self._restore(h, p, self._clock)
            self._cached.add(p)
        return k

    def defragment(self, max_moves: int | None = None, *, resuming: bool = False) -> int:
        """When no sequence is live, pack cached trees contiguously from page 0, longest first.

        Contiguous chains make each sequence's pages ascending runs, which attention
        reads in place instead of gathering them (benchmarks/defrag.py). Each tree is
        followed by up to `DEFRAG_GAP_PAGES` free pages when the pool has room, so a
        conversation's next turn extends its run instead of landing elsewhere (see
        `_allocate`). Skipped (returns 0) when fewer than 10% of pages would move, unless
        `resuming` a pass that `max_moves` cut short (the engine moves a slice of pages
        per idle step), which then finishes the layout it started. Returns pages moved.
        """
        if self._seqs:
            return 0
        trees = self._defrag_layout()
        cached = sum(len(t) for t in trees)
        spare_pages = self.num_pages - cached
        gap = min(DEFRAG_GAP_PAGES, spare_pages // len(trees)) if trees else 0
        targets: list[tuple[int, _Page]] = []
        t = 0
        for tree in trees:
            for page in tree:
                targets.append((t, page))
                t += 1
            t += gap
        misplaced = sum(1 for t, page in targets if page.index != t)
        if misplaced == 0 or (misplaced * 10 < self.num_pages and not resuming):
            return 0
        limit = max_moves if max_moves is not None else 2 * self.num_pages
        free = set(self._free)
        moves = 0
        for t, page in targets:
            if page.index == t:
                continue
            if self._pages[t].tokens:  # occupied by a page that belongs elsewhere: park it
                spare = max((f for f in free if f != t), default=None)
                if spare is None or moves + 2 > limit:
                    break
                self._move(t, spare, free)
                moves += 1
            if moves + 1 > limit:
                break
            self._move(page.index, t, free)
            moves += 1
        self._free = sorted(free)  # a sorted list is a valid heap
        return moves

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> PageTableStats:
        c = self._counters
        free = len(self._free)
        cached = len(self._cached)
        device = TierStats(self.num_pages, self.num_pages - free - cached, cached, free)
        if self.host is None:
            host = TierStats(0, 0, 0, 0)
            dropped = 0
        else:
            host = TierStats(self.host.num_slots, 0, len(self.host), self.host.free_slots)
            dropped = self.host.dropped
        return PageTableStats(
            device=device,
            host=host,
            device_to_host=c.device_to_host,
            host_dropped=dropped,
            device_dropped=c.device_dropped,
            prompt_tokens=c.prompt_tokens,
            cached_device=c.cached_device,
            cached_host=c.cached_host,
            cached_disk=c.cached_disk,
            prefilled_tokens=c.prefilled_tokens,
            recomputed_tokens=c.recomputed_tokens,
        )

    def page_info(self, index: int) -> PageInfo:
        page = self._pages[index]
        indexed = page.hash is not None and self._index.get(page.hash) == index
        return PageInfo(
            index,
            page.hash,
            page.parent,
            tuple(page.tokens),
            page.refcount,
            page.last_used,
            indexed,
        )

    def validate(self) -> None:
        """Check every invariant; raise `PageTableCorrupt` naming the first broken one."""
        problems = self._problems()
        if problems:
            raise PageTableCorrupt("; ".join(problems[:5]))

    def _problems(self) -> list[str]:
        out: list[str] = []
        ps = self.page_size
        free = set(self._free)
        if len(free) != len(self._free):
            out.append("a page is on the free list twice")
        refs: dict[int, int] = {}
        for sid, seq in self._seqs.items():
            if len(set(seq.pages)) != len(seq.pages):
                out.append(f"sequence {sid} holds a page twice: {seq.pages}")
            if not 0 <= seq.num_tokens <= len(seq.pages) * ps:
                out.append(f"sequence {sid}: {seq.num_tokens} tokens in {len(seq.pages)} pages")
            for i, p in enumerate(seq.pages):
                refs[p] = refs.get(p, 0) + 1
                page = self._pages[p]
                want = min(ps, max(0, seq.num_tokens - i * ps))
                if len(page.tokens) != want:
                    out.append(
                        f"sequence {sid} page #{i} (device {p}) holds {len(page.tokens)} "
                        f"tokens, expected {want}"
                    )
                if page.tokens:
                    parent = self.salt if i == 0 else self._pages[seq.pages[i - 1]].hash
                    if page.parent != parent:
                        out.append(f"sequence {sid} page #{i} (device {p}) has a wrong parent")
        for p, page in enumerate(self._pages):
            if page.index != p:
                out.append(f"page record {p} says it is page {page.index}")
            states = [p in free, page.refcount > 0, p in self._cached]
            if sum(states) != 1:
                out.append(
                    f"page {p} is in {sum(states)} of free/referenced/cached "
                    f"(free={states[0]}, refcount={page.refcount}, cached={states[2]})"
                )
            if page.refcount != refs.get(p, 0):
                out.append(f"page {p}: refcount {page.refcount} but {refs.get(p, 0)} holders")
            if page.last_used > self._clock:
                out.append(f"page {p}: last_used {page.last_used} is after the clock")
            if p in free and (page.tokens or page.hash is not None or page.parent is not None):
                out.append(f"free page {p} still has content")
            if p in self._cached and not page.tokens:
                out.append(f"cached page {p} holds no tokens")
            if not page.tokens:
                if page.hash is not None or page.parent is not None:
                    out.append(f"empty page {p} has a hash or parent")
                continue
            if len(page.tokens) > ps:
                out.append(f"page {p} holds {len(page.tokens)} tokens > page size")
            if page.parent is None:
                out.append(f"page {p} has tokens but no parent")
            elif p not in self._children.get(page.parent, ()):
                out.append(f"page {p} is missing from its parent's children")
            if len(page.tokens) == ps:
                h = page.hash
                if h is None or (self._index.get(h) != p and p not in self._dups.get(h, ())):
                    out.append(f"full page {p} is neither indexed nor a listed duplicate")
                if page.hash is None or page.parent is None:
                    out.append(f"full page {p} has no hash")
                elif page_hash(page.parent, page.tokens) != page.hash:
                    out.append(f"full page {p}: stored hash differs from the hash of its tokens")
                if p in self._cached and self._index.get(page.hash or b"") != p:
                    out.append(f"cached full page {p} is not indexed")
            elif page.hash is not None:
                out.append(f"partial page {p} has a hash")
        for h, p in self._index.items():
            page = self._pages[p]
            if page.hash != h or len(page.tokens) != ps:
                out.append(f"index entry for page {p} names a page that is not that full page")
        for h, dups in self._dups.items():
            if not dups:
                out.append("an empty duplicate set was left behind")
            if h not in self._index:
                out.append("a page computed twice has no indexed copy")
            for p in dups:
                page = self._pages[p]
                if page.hash != h or page.refcount == 0 or self._index.get(h) == p:
                    out.append(f"page {p} is listed as a live duplicate but is not one")
        for parent, kids in self._children.items():
            if not kids:
                out.append("an empty children set was left behind")
            for p in kids:
                if self._pages[p].parent != parent or not self._pages[p].tokens:
                    out.append(f"page {p} is listed under a parent it does not have")
        if self.host is not None:
            out.extend(self.host.problems(ps))
        c = self._counters
        values = vars(c).values()
        if any(v < 0 for v in values):
            out.append(f"a counter is negative: {c}")
        if c.prompt_tokens != c.cached_device + c.cached_host + c.cached_disk + c.prefilled_tokens:
            out.append(f"prompt tokens != cached + prefilled: {c}")
        return out

    # ---- internals -----------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not live")
        return seq

    def _walk(self, tokens: tuple[int, ...], limit: int, *, host_tail: bool) -> _Walk:
        """Match `tokens` against both tiers, covering at most `limit` tokens. Changes nothing."""
        ps = self.page_size
        host = self.host
        chain: list[tuple[bytes, int | None]] = []
        prev = self.salt
        capped: bytes | None = None
        i = 0
        while (i + 1) * ps <= len(tokens):
            h = page_hash(prev, tokens[i * ps : (i + 1) * ps])
            if (i + 1) * ps > limit:
                capped = h  # a full hit here would leave nothing to compute: reuse it as a tail
                break
            p = self._index.get(h)
            if p is not None:
                chain.append((h, p))
            elif host is not None and h in host:
                chain.append((h, None))
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
            for p in self._children.get(prev, ()):
                m = _common_prefix(self._pages[p].tokens, want)
                # the longest match wins; the lowest page number breaks ties (deterministic)
                if m > best or (m == best > 0 and tail_src is not None and p < tail_src):
                    best, tail_src = m, p
            restorable = capped is not None and host is not None and capped in host
            if host_tail and best < max_m and restorable:
                best, tail_src, tail_host = max_m, None, capped
        return _Walk(chain, prev, tail_src, tail_host, best)

    def _can_allocate(self, n: int, keep: set[int]) -> bool:
        evictable = len(self._cached) - len(self._cached & keep)
        return n <= len(self._free) + evictable

    def _can_take_over(self, p: int, matched: int) -> bool:
        """Whether an admitted sequence may extend cached partial page `p` in place.

        Copying a matched tail into a fresh page keeps the cached one for others, but
        puts the sequence's next tokens on a page away from its history. When the
        cached page holds exactly the matched tokens (a conversation's previous turn
        ended there) nothing is lost by extending it instead: its content stays a
        prefix of the page, and the sequence's pages stay one ascending run.
        """
        page = self._pages[p]
        return p in self._cached and page.hash is None and len(page.tokens) == matched

    def _allocate(
        self, n: int, keep: set[int], protect_host: set[bytes], *, after: int | None = None
    ) -> list[int]:
        """Take `n` pages: free ones first, then victims (never `keep`). Caller checked it fits.

        Free pages come as one ascending run when there is one: right after `after` (the
        sequence's current last page), else mid-way into the largest free run. A sequence
        whose pages are consecutive is a plain slice of the store, which attention reads in place;
        scattered pages must be gathered (copied) every step (benchmarks/defrag.py).
        """
        out = self._take_free_run(n, after)
        order: list[int] | None = None
        pos = 0
        while len(out) < n:
            if self._free:
                out.append(heapq.heappop(self._free))
                continue
            if order is None:
                order = self._eviction_order(keep)
            victim = order[pos]
            pos += 1
            self._evict(victim, protect_host)
            out.append(victim)
        return out

    def _take_free_run(self, n: int, after: int | None) -> list[int]:
        """Remove and return `n` consecutive free pages, or none if no such run exists.

        Right after `after` when those pages are free (the sequence stays one run).
        Otherwise in the middle of the largest free run: a sequence grows forward, so
        the free pages left after it let it keep growing in place, and the pages left
        before it serve the next sequence the same way. Packing sequences at the lowest
        run instead makes every one that grows past its page jump elsewhere and be
        gathered (copied) at every decode step from then on.
        """
        if n <= 0 or len(self._free) < n:
            return []
        free = set(self._free)
        start: int | None = None
        if after is not None and all(after + 1 + i in free for i in range(n)):
            start = after + 1
        else:
            best_start, best_len = 0, 0
            run_start, run_len, prev = 0, 0, -2
            for p in sorted(free):
                run_start, run_len = (run_start, run_len + 1) if p == prev + 1 else (p, 1)
                prev = p
                if run_len > best_len:
                    best_start, best_len = run_start, run_len
            if best_len >= n:
                start = best_start + (best_len - n) // 2
        if start is None:
            return []
        self._free = [p for p in self._free if not start <= p < start + n]
        heapq.heapify(self._free)
        return list(range(start, start + n))

    def _eviction_order(self, keep: set[int]) -> list[int]:
        """Cached pages, first victim first (see the class docstring for why this order)."""
        memo: dict[bytes, _Place] = {self.salt: _Place(False, None, b"", 0)}
        keyed: list[tuple[int, int, bytes, int, int]] = []
        for p in self._cached:
            if p in keep:
                continue
            page = self._pages[p]
            assert page.parent is not None
            above = self._resolve(page.parent, memo)
            depth = above.depth + 1
            if above.orphan:
                keyed.append((0, 0, b"", -depth, p))
            elif above.root_clock is None:  # this page is its tree's root
                keyed.append((1, page.last_used, page.hash or b"", -depth, p))
            else:
                keyed.append((1, above.root_clock, above.root, -depth, p))
        keyed.sort()
        return [k[-1] for k in keyed]

    def _resolve(self, h: bytes, memo: dict[bytes, _Place]) -> _Place:
        """Where the page named `h` sits in its tree, looked up through both tiers."""
        path: list[tuple[bytes, int]] = []
        cur = h
        while cur not in memo:
            p = self._index.get(cur)
            if p is not None:
                parent, used = self._pages[p].parent, self._pages[p].last_used
            elif self.host is not None and cur in self.host:
                parent, used = self.host.parent_of(cur), self.host.last_used(cur)
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

    def _evict(self, p: int, protect_host: set[bytes]) -> None:
        """Empty a cached page: to the host tier if it is a full indexed page, else dropped."""
        page = self._pages[p]
        c = self._counters
        h = page.hash
        if h is not None and self.host is not None and self._index.get(h) == p:
            if h in self.host:
                self.host.touch(h, page.last_used)  # already there: no copy needed
                c.device_to_host += 1
            else:
                assert page.parent is not None
                slot = self.host.put(
                    h,
                    page.parent,
                    tuple(page.tokens),
                    page.last_used,
                    anchored=self._anchored,
                    protect=protect_host,
                )
                if slot is None:
                    c.device_dropped += 1
                else:
                    self._mover.device_to_host(p, slot)
                    c.device_to_host += 1
        else:
            c.device_dropped += 1
        self._clear(p)

    def _anchored(self, h: bytes) -> bool:
        return h == self.salt or h in self._index

    def _clear(self, p: int) -> None:
        """Forget a page's content (it leaves the index, its parent's children and the cache)."""
        page = self._pages[p]
        h = page.hash
        if h is not None and self._index.get(h) == p:
            del self._index[h]
            dups = self._dups.get(h)
            if dups:  # a live copy of the same page stays matchable
                self._index[h] = dups.pop()
                if not dups:
                    del self._dups[h]
        elif h is not None and p in self._dups.get(h, ()):
            self._dups[h].discard(p)
            if not self._dups[h]:
                del self._dups[h]
        if page.parent is not None:
            kids = self._children[page.parent]
            kids.discard(p)
            if not kids:
                del self._children[page.parent]
        self._cached.discard(p)
        page.hash = None
        page.parent = None
        page.tokens = []
        page.last_used = 0

    def _ref(self, p: int, clock: int) -> None:
        page = self._pages[p]
        if page.refcount == 0:
            self._cached.discard(p)
        page.refcount += 1
        page.last_used = clock

    def _restore(self, h: bytes, p: int, clock: int) -> None:
        """Copy host page `h` into empty device page `p` and index it (refcount left at 0)."""
        assert self.host is not None
        entry = self.host.get(h)
        assert entry is not None
        self._mover.host_to_device(entry.slot, p)
        self.host.touch(h, clock)
        page = self._pages[p]
        page.hash = h
        page.parent = entry.parent
        page.tokens = list(entry.tokens)
        page.last_used = clock
        self._index[h] = p
        self._children.setdefault(entry.parent, set()).add(p)

    def _settle(self, p: int) -> None:
        """A page's last holder let go: keep it as cache if it can be matched, else free it."""
        page = self._pages[p]
        if not page.tokens:
            heapq.heappush(self._free, p)
            return
        if len(page.tokens) == self.page_size:
            assert page.hash is not None
            if self._index[page.hash] != p:  # a duplicate of an indexed page: nothing to keep
                self._clear(p)
                heapq.heappush(self._free, p)
                return
        elif self._is_dominated(p):
            self._clear(p)
            heapq.heappush(self._free, p)
            return
        self._cached.add(p)
        self._drop_dominated_siblings(p)

    def _is_dominated(self, p: int) -> bool:
        """A partial page is useless when a kept sibling starts with all of its tokens."""
        page = self._pages[p]
        assert page.parent is not None
        n = len(page.tokens)
        for q in self._children.get(page.parent, ()):
            other = self._pages[q]
            if q == p or len(other.tokens) < n or other.tokens[:n] != page.tokens:
                continue
            if q in self._cached or (other.hash is not None and self._index.get(other.hash) == q):
                return True
        return False

    def _drop_dominated_siblings(self, p: int) -> None:
        """Free cached partial pages whose tokens are a prefix of page `p`'s: `p` matches better."""
        page = self._pages[p]
        assert page.parent is not None
        for q in list(self._children.get(page.parent, ())):
            other = self._pages[q]
            n = len(other.tokens)
            if (
                q != p
                and q in self._cached
                and n < self.page_size
                and n <= len(page.tokens)
                and page.tokens[:n] == other.tokens
            ):
                self._clear(q)
                heapq.heappush(self._free, q)

    def _defrag_layout(self) -> list[list[_Page]]:
        """Cached pages in target order, per tree: trees longest chain first, each depth first."""
        kids: dict[int, list[int]] = {}
        roots: list[int] = []
        for p in self._cached:
            page = self._pages[p]
            assert page.parent is not None
            parent = self._index.get(page.parent)
            if parent is not None and parent in self._cached:
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
        trees: list[list[_Page]] = []
        for r in sorted(roots, key=lambda r: (-height[r], r)):
            order: list[_Page] = []
            trees.append(order)
            stack = [r]
            while stack:
                p = stack.pop()
                order.append(self._pages[p])
                # push the tallest child last so it is laid out right after its parent
                stack.extend(sorted(kids.get(p, ()), key=lambda k: (height[k], -k)))
        return trees

    def _move(self, src: int, dst: int, free: set[int]) -> None:
        """Move a cached page's K/V and bookkeeping from `src` to the free page `dst`."""
        self._mover.move_page(src, dst)
        page = self._pages[src]
        self._pages[dst] = page
        self._pages[src] = _Page(src)
        page.index = dst
        if page.hash is not None and self._index.get(page.hash) == src:
            self._index[page.hash] = dst
        assert page.parent is not None
        kids = self._children[page.parent]
        kids.discard(src)
        kids.add(dst)
        self._cached.discard(src)
        self._cached.add(dst)
        free.discard(dst)
        free.add(src)


def _opt(x: int | bytes | None) -> set:
    return set() if x is None else {x}
