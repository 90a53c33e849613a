"""The paged KV cache's page table: which page holds which tokens, who shares it, what to evict.

A sequence's K/V lives in fixed-size device pages of `page_size` token slots.
Each full page is named by a chained hash (see `page_hash`), so one hash names a
whole prefix; pages are shared by reference count between live sequences, and a
finished sequence's pages stay indexed as the prompt cache. A new request walks
its full pages: shared or cached on the device → restored from the host tier →
read back from the disk tier → computed. The ragged tail of a previous turn (a
partial page) is reused by copying its matching tokens into a fresh page, so
switching back to a
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
Its parts each live in a file: `prefix_index` (hash -> page, tails), `free_pages`
(the allocator), `eviction` (the victim order and why), `defragment` (idle
packing) and `page_table_invariants` (the checker behind `validate()`). What
stays here is one class on purpose: admission, commit and release each change the
pages, the index, the free list and the counters in one step, and the invariants
tie those together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvchat.engine.cache.cache_counters import CacheCounters
from kvchat.engine.cache.defragment import (
    defrag_layout,
    defrag_targets,
    move_into_place,
)
from kvchat.engine.cache.eviction import eviction_order
from kvchat.engine.cache.free_pages import FreePages
from kvchat.engine.cache.page_hash import page_hash
from kvchat.engine.cache.page_records import Page, SeqPages
from kvchat.engine.cache.page_table_invariants import page_table_problems
from kvchat.engine.cache.prefix_index import PrefixIndex
from kvchat.engine.events import CachedTokens
from kvchat.engine.per_tier import PerTier
from kvchat.engine.stats import Residency, TierPages
from kvchat.engine.tiers.host_tier import HostTier


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

    # the disk tier's side: a page's K/V as opaque CPU data (tensors for the real mover)
    def snapshot_device(self, device_page: int) -> Any: ...

    def snapshot_host(self, host_slot: int) -> Any: ...

    def load_device(self, parts: Any, device_page: int) -> None: ...


class DiskStore(Protocol):
    """The disk tier as the page table uses it (`disk_tier.DiskTier` is the real one)."""

    def __contains__(self, h: object) -> bool: ...

    def save(self, h: bytes, parent: bytes, tokens: tuple[int, ...], parts: Any) -> bool:
        """Keep page `h` (queued, written in the background); False if it cannot be kept."""
        ...

    def load(self, h: bytes) -> Any | None:
        """Page `h`'s data, or None when it cannot be served (vanished, or failed a check)."""
        ...

    def touch(self, h: bytes) -> None: ...

    def problems(self) -> list[str]: ...


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
    cached_draft: int = 0  # of cached.device: tokens that drafts computed and no turn had used

    @property
    def cached_tokens(self) -> int:
        return self.cached.total


@dataclass(frozen=True)
class PageTableStats:
    """A snapshot of the page table: pages per tier and its counters."""

    pages: PerTier[TierPages]  # disk: empty here (the disk tier counts its own pages)
    counters: CacheCounters


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
    draft_from: int | None = None  # slots from here on a draft computed and no turn used yet


class PageTable:
    """Device pages of one KV pool: allocation, prefix sharing, eviction, host tier, defrag.

    When no page is free, cached pages are evicted in the order `eviction` gives
    (orphans, pages only drafts computed, then whole trees by least-recently-used
    root, deepest page first).
    Evicting a full indexed page copies it to the host tier (or finds it there
    already); a partial page, or any page without a host tier, is dropped.
    Referenced pages are never victims.

    With a disk tier, the full pages of a sequence are saved when it is released
    (its turn finished; written in the background), and a page leaving the host
    tier, or leaving the device with no host room, is saved first if it is not on
    disk yet: a page leaves RAM without being lost.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        salt: bytes,
        host: HostTier | None,
        mover: PageMover,
        disk: DiskStore | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.salt = salt
        self.host = host
        self.disk = disk
        self._mover = mover
        self._pages = [Page(i) for i in range(num_pages)]
        self._free = FreePages(range(num_pages))  # lowest page first, so pages stay packed
        self._cached: set[int] = set()  # refcount 0, holding content
        self._index = PrefixIndex(self._pages, page_size)
        self._seqs: dict[int, SeqPages] = {}
        self._clock = 0  # logical: one tick per operation
        self._counters = CacheCounters()

    # ---- admission -----------------------------------------------------------------------

    def reserve(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        *,
        count_as: Literal["prompt", "recompute", "draft"],
    ) -> Reservation | None:
        """Admit a sequence whose K/V must cover `token_ids`; None (no change) if it cannot fit.

        Full pages are matched by hash (shared on the device, else restored from the
        host), then the longest matching prefix of a page under the last matched
        hash is copied as the tail. At most `len(token_ids) - 1` tokens count as
        cached: the engine must compute at least the last one to get its logits.

        A draft (`count_as="draft"`) gets no slot for a generated token, counts in no
        prompt counter, and marks what it writes as a draft's (`commit`); a prompt's
        reservation takes such pages over as its own and counts them in `cached_draft`.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already live")
        if count_as not in ("prompt", "recompute", "draft"):
            raise ValueError(f"count_as must be 'prompt', 'recompute' or 'draft', got {count_as!r}")
        is_draft = count_as == "draft"
        tokens = tuple(map(int, token_ids))
        n = len(tokens)
        if n == 0:
            raise ValueError("a sequence needs at least one token")
        ps = self.page_size
        walk = self._index.walk(tokens, n - 1, self.salt, self.host, host_tail=True, disk=self.disk)
        device_hits = [p for _, p in walk.chain if p is not None]
        # ceil((n + 1) / ps): the prompt plus one generated token; a draft generates none
        total_pages = -(-n // ps) if is_draft else n // ps + 1
        need = total_pages - len(device_hits)
        pinned = set(device_hits)
        takeover = walk.tail_src is not None and self._can_take_over(walk.tail_src, walk.tail_len)
        if not self._can_allocate(need - int(takeover), pinned | _opt(walk.tail_src)):
            if walk.tail_src is None or not self._can_allocate(need, pinned):
                return None
            walk.tail_src, walk.tail_len = None, 0  # make room by giving up the tail copy
            takeover = False
        from_disk = self._load_from_disk(walk.chain)
        if from_disk is None:  # a page file failed its checks and is gone: match again
            return self.reserve(seq_id, token_ids, count_as=count_as)

        self._clock += 1
        clock = self._clock
        cached_draft = 0
        for p in device_hits:
            if not is_draft:
                cached_draft += self._take_from_draft(p, self.page_size)
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
        cached_host = cached_disk = 0
        parent = self.salt
        for i, (h, p) in enumerate(walk.chain):
            if p is None:  # restore from the host tier, or read back from disk
                p = next(it)
                if h in from_disk:
                    page_tokens = tokens[i * ps : (i + 1) * ps]
                    self._restore_from_disk(h, parent, page_tokens, from_disk[h], p, clock)
                    cached_disk += ps
                else:
                    self._restore(h, p, clock)
                    cached_host += ps
                self._pages[p].refcount = 1
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
                if not is_draft:
                    cached_draft += self._take_from_draft(p, m)
            elif walk.tail_src is not None:
                src = self._pages[walk.tail_src]
                self._mover.copy_tokens(walk.tail_src, p, m)
                page.tokens = src.tokens[:m]
                src.last_used = clock
                cached_device += m
                reused_tail = m
                guessed = src.draft_from is not None and src.draft_from < m
                if guessed and is_draft:  # the copy is as much a guess as its source
                    page.draft_from = src.draft_from
                elif guessed:
                    cached_draft += m - (src.draft_from or 0)
            else:
                assert walk.tail_host is not None and self.host is not None
                slot = self.host.slot_of(walk.tail_host)
                assert slot is not None
                self._mover.host_to_device(slot, p)
                page.tokens = list(tokens[len(pages) * ps : len(pages) * ps + m])
                self.host.touch(walk.tail_host, clock)
                cached_host += m
            page.parent = parent
            self._index.add_child(parent, p)
            page.refcount = 1
            page.last_used = clock
            pages.append(p)
        for p in it:
            self._pages[p].refcount = 1
            self._pages[p].last_used = clock
            pages.append(p)

        found = CachedTokens(cached_device, cached_host, cached_disk)
        self._seqs[seq_id] = SeqPages(pages, found.total, is_draft)
        if count_as == "prompt":
            self._counters = self._counters.prompt_admitted(n, found, cached_draft)
        elif count_as == "recompute":
            self._counters = self._counters.plus(recomputed_tokens=n - found.total)
        return Reservation(seq_id, tuple(pages), found, reused_tail, found.total, cached_draft)

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
        if seq.draft:
            self._counters = self._counters.plus(draft_tokens=len(token_ids))
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
                self._index.add_child(parent, p)
            take = min(ps - pos % ps, len(token_ids) - done)
            if seq.draft and page.draft_from is None:
                page.draft_from = len(page.tokens)
            page.tokens.extend(token_ids[done : done + take])
            page.last_used = self._clock
            done += take
            seq.num_tokens += take
            if len(page.tokens) == ps:
                assert page.parent is not None
                page.hash = page_hash(page.parent, page.tokens)
                if self._index.add_full(page.hash, p):
                    self._drop_dominated_siblings(p)

    def release(self, seq_id: int) -> None:
        """End a sequence: its full pages stay as the prompt cache, its partial page as a tail."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not live")
        self._clock += 1
        if self.disk is not None and not seq.draft:  # a draft's pages are guesses: not kept
            self._save_to_disk(seq.pages)
        for p in reversed(seq.pages):
            page = self._pages[p]
            page.refcount -= 1
            page.last_used = self._clock
            if page.refcount == 0:
                self._settle(p)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seq(seq_id).pages)

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def is_live(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # ---- cache queries and upkeep --------------------------------------------------------

    def residency(self, token_ids: Sequence[int]) -> Residency:
        """Where this token history's K/V is, without changing any state (not even the clock)."""
        tokens = tuple(token_ids)
        walk = self._index.walk(
            tokens, len(tokens), self.salt, self.host, host_tail=False, disk=self.disk
        )
        ps = self.page_size
        device = sum(ps for _, p in walk.chain if p is not None) + walk.tail_len
        lower = [h for h, p in walk.chain if p is None]
        host = sum(ps for h in lower if self.host is not None and h in self.host)
        disk = len(lower) * ps - host
        return Residency(device, host, disk, nowhere=len(tokens) - device - host - disk)

    def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring back to the device the pages of this history that only the host or disk holds.

        They become unreferenced cached device pages, so the next `reserve` of this
        history finds them on the device. Only free pages and evictable cached pages
        of other chains are used. Returns the number of pages restored.
        """
        tokens = tuple(token_ids)
        walk = self._index.walk(
            tokens, len(tokens), self.salt, self.host, host_tail=False, disk=self.disk
        )
        on_device = {p for _, p in walk.chain if p is not None}
        k = min(
            sum(1 for _, p in walk.chain if p is None),
            len(self._free) + len(self._cached - on_device),
        )
        if k == 0:
            return 0
        # the first k pages not on the device, each with its parent and tokens
        wanted: list[tuple[bytes, bytes, tuple[int, ...]]] = []
        parent, ps = self.salt, self.page_size
        for i, (h, p) in enumerate(walk.chain):
            if p is None and len(wanted) < k:
                wanted.append((h, parent, tokens[i * ps : (i + 1) * ps]))
            parent = h
        from_disk = self._load_from_disk([(h, None) for h, _, _ in wanted])
        if from_disk is None:  # a page file failed its checks and is gone: look again
            return self.prefetch(token_ids)
        self._clock += 1
        for p in on_device:
            self._pages[p].last_used = self._clock
        fresh = self._allocate(k, on_device, {h for h, _ in walk.chain})
        for (h, parent, page_tokens), p in zip(wanted, fresh, strict=True):
            if h in from_disk:
                self._restore_from_disk(h, parent, page_tokens, from_disk[h], p, self._clock)
            else:
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
        targets = defrag_targets(
            defrag_layout(self._cached, self._pages, self._index), self.num_pages
        )
        misplaced = sum(1 for t, page in targets if page.index != t)
        if misplaced == 0 or (misplaced * 10 < self.num_pages and not resuming):
            return 0
        limit = max_moves if max_moves is not None else 2 * self.num_pages
        free = set(self._free.pages())
        moves = move_into_place(targets, self._pages, free, limit, self._move)
        self._free.replace(free)
        return moves

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> PageTableStats:
        free = len(self._free)
        cached = len(self._cached)
        device = TierPages(self.num_pages, self.num_pages - free - cached, cached, free)
        host = TierPages()
        if self.host is not None:
            host = TierPages(self.host.num_slots, 0, len(self.host), self.host.free_slots)
        return PageTableStats(PerTier(device, host, TierPages()), self._counters)

    def page_info(self, index: int) -> PageInfo:
        page = self._pages[index]
        indexed = self._index.is_indexed(index)
        return PageInfo(
            index,
            page.hash,
            page.parent,
            tuple(page.tokens),
            page.refcount,
            page.last_used,
            indexed,
            page.draft_from,
        )

    def validate(self) -> None:
        """Check every invariant; raise `PageTableCorrupt` naming the first broken one."""
        problems = self._problems()
        if problems:
            raise PageTableCorrupt("; ".join(problems[:5]))

    def _problems(self) -> list[str]:
        out = page_table_problems(
            page_size=self.page_size,
            salt=self.salt,
            clock=self._clock,
            pages=self._pages,
            free_list=self._free.pages(),
            cached=self._cached,
            index=self._index,
            seqs=self._seqs,
            host=self.host,
            counters=self._counters,
        )
        ev = self._counters.evictions
        if self.host is not None and ev.host_to_disk + ev.host_dropped != self.host.dropped:
            out.append("pages that left the host (to disk or lost) != the host's drops")
        if self.disk is not None:
            out.extend(self.disk.problems())
        return out

    # ---- internals -----------------------------------------------------------------------

    def _seq(self, seq_id: int) -> SeqPages:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not live")
        return seq

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
        out = self._free.take_run(n, after)
        order: list[int] | None = None
        pos = 0
        while len(out) < n:
            if self._free:
                out.append(self._free.pop_lowest())
                continue
            if order is None:
                order = eviction_order(
                    self._cached, keep, self._pages, self._index, self.host, self.salt
                )
            victim = order[pos]
            pos += 1
            self._evict(victim, protect_host)
            out.append(victim)
        return out

    def _evict(self, p: int, protect_host: set[bytes]) -> None:
        """Empty a cached page: to the host tier if it is a full indexed page, else dropped."""
        page = self._pages[p]
        h = page.hash
        if h is not None and self.host is not None and self._index.get(h) == p:
            if h in self.host:
                self.host.touch(h, page.last_used)  # already there: no copy needed
                self._counters = self._counters.evicted(device_to_host=1)
            else:
                assert page.parent is not None
                slot = self.host.put(
                    h,
                    page.parent,
                    tuple(page.tokens),
                    page.last_used,
                    anchored=self._anchored,
                    protect=protect_host,
                    before_drop=self._leaving_host,
                )
                if slot is None:
                    self._device_page_lost(p)
                else:
                    self._mover.device_to_host(p, slot)
                    self._counters = self._counters.evicted(device_to_host=1)
        else:
            self._device_page_lost(p)
        self._clear(p)

    def _device_page_lost(self, p: int) -> None:
        """Page `p` leaves the device with no host room: dropped, unless disk can keep it."""
        page = self._pages[p]
        h = page.hash
        if self.disk is not None and h is not None and self._index.get(h) == p:
            assert page.parent is not None
            if h in self.disk or self.disk.save(
                h, page.parent, tuple(page.tokens), self._mover.snapshot_device(p)
            ):
                self._counters = self._counters.plus(device_to_disk=1)
                return
        self._counters = self._counters.evicted(device_dropped=1)

    def _leaving_host(self, h: bytes, slot: int) -> None:
        """A host slot is about to be reused: its page goes to disk first unless already there."""
        kept = False
        if self.disk is not None and self.host is not None:
            kept = h in self.disk
            if not kept:
                entry = self.host.get(h)
                assert entry is not None
                parts = self._mover.snapshot_host(slot)
                kept = self.disk.save(h, entry.parent, entry.tokens, parts)
        if kept:
            self._counters = self._counters.evicted(host_to_disk=1)
        else:  # lost entirely
            self._counters = self._counters.evicted(host_dropped=1)

    def _load_from_disk(self, chain: list[tuple[bytes, int | None]]) -> dict[bytes, Any] | None:
        """Read the chain's pages that only the disk holds; None if one failed (it is gone)."""
        out: dict[bytes, Any] = {}
        if self.disk is None:
            return out
        for h, p in chain:
            if p is None and (self.host is None or h not in self.host):
                parts = self.disk.load(h)
                if parts is None:
                    return None
                out[h] = parts
        return out

    def _save_to_disk(self, pages: list[int]) -> None:
        """Queue the disk writes of a released sequence's full pages that disk lacks."""
        assert self.disk is not None
        for i, p in enumerate(pages):
            page = self._pages[p]
            h = page.hash
            if h is None or self._index.get(h) != p:
                break  # the chain's full, indexed pages come first
            if h in self.disk:
                if i == 0:
                    self.disk.touch(h)  # a tree's order of use is its root's
                continue
            assert page.parent is not None
            self.disk.save(h, page.parent, tuple(page.tokens), self._mover.snapshot_device(p))

    def _restore_from_disk(
        self, h: bytes, parent: bytes, tokens: tuple[int, ...], parts: Any, p: int, clock: int
    ) -> None:
        """Copy a page read from disk into empty device page `p` and index it."""
        self._mover.load_device(parts, p)
        page = self._pages[p]
        page.hash = h
        page.parent = parent
        page.tokens = list(tokens)
        page.last_used = clock
        self._index.add_restored(h, parent, p)

    def _anchored(self, h: bytes) -> bool:
        return h == self.salt or h in self._index

    def _clear(self, p: int) -> None:
        """Forget a page's content (it leaves the index, its parent's children and the cache)."""
        page = self._pages[p]
        self._index.forget(p)
        self._cached.discard(p)
        page.hash = None
        page.parent = None
        page.tokens = []
        page.last_used = 0
        page.draft_from = None

    def _take_from_draft(self, p: int, matched: int) -> int:
        """A turn uses page `p`'s first `matched` slots: no longer a guess. Returns draft tokens."""
        page = self._pages[p]
        start = page.draft_from
        if start is None:
            return 0
        page.draft_from = None
        return max(0, matched - start)

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
        self._index.add_restored(h, entry.parent, p)

    def _settle(self, p: int) -> None:
        """A page's last holder let go: keep it as cache if it can be matched, else free it."""
        page = self._pages[p]
        if not page.tokens:
            self._free.push(p)
            return
        if len(page.tokens) == self.page_size:
            assert page.hash is not None
            if self._index.get(page.hash) != p:  # a duplicate of an indexed page: nothing to keep
                self._clear(p)
                self._free.push(p)
                return
        elif self._is_dominated(p):
            self._clear(p)
            self._free.push(p)
            return
        self._cached.add(p)
        self._drop_dominated_siblings(p)

    def _is_dominated(self, p: int) -> bool:
        """A partial page is useless when a kept sibling starts with all of its tokens."""
        page = self._pages[p]
        assert page.parent is not None
        n = len(page.tokens)
        for q in self._index.children_of(page.parent):
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
        for q in list(self._index.children_of(page.parent)):
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
                self._free.push(q)

    def _move(self, src: int, dst: int) -> None:
        """Move a cached page's K/V and bookkeeping from `src` to the free page `dst`."""
        self._mover.move_page(src, dst)
        page = self._pages[src]
        self._pages[dst] = page
        self._pages[src] = Page(src)
        page.index = dst
        self._index.moved(page, src, dst)
        self._cached.discard(src)
        self._cached.add(dst)


def _opt(x: int | bytes | None) -> set:
    return set() if x is None else {x}
