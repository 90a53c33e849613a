"""The paged KV cache's page table: which page holds which tokens, who shares it, what to evict.

A sequence's K/V lives in fixed-size device pages of `page_size` token slots.
Each full page is named by a chained hash (see `page_hash`), so one hash names a
whole prefix; pages are shared by reference count between live sequences, and a
finished sequence's pages stay indexed as the prompt cache. `reserve` walks a
request's full pages by chained hash (`admission`), then resolves each page in one
loop: a device hit, a host restore, a disk restore, or a page to compute; then the
tail, the partial page of a previous turn, whose matching tokens are copied into a
fresh page (or extended in place when it holds exactly them). So switching back to a
conversation recomputes only what is new since its last turn.

This module is pure bookkeeping (no torch): whenever K/V must physically move
(to the host on eviction, back on a hit, a tail copy, a defragmenting move) the
table calls its `PageMover` at once, before the page is reused, so the data
always follows the table. Costs are proportional to the pages an operation
touches (dict indexes, a free-page heap), except victim selection, which scans
the cached pages once per allocation that has to evict.

The table is not thread-safe: the engine calls it from its step thread only.
Its parts each live in a file: `prefix_index` (hash -> page, tails), `free_pages`,
`eviction` (the victim order and why), `lower_tiers` (the host and disk tiers),
`admission` (what a request needs), `defragment`, `page_table_views` (what it hands
out) and `page_table_invariants` (behind `validate()`). What stays here is one class
on purpose: admission, commit and release each change the pages, the index, the free
list and the counters in one step, and the invariants tie those together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from kvchat.engine.cache.admission import Admission, plan_admission
from kvchat.engine.cache.cache_counters import CacheCounters, EvictionKind
from kvchat.engine.cache.defragment import defrag_layout, defrag_targets, move_into_place
from kvchat.engine.cache.eviction import eviction_order
from kvchat.engine.cache.free_pages import FreePages
from kvchat.engine.cache.lower_tiers import DiskStore, LowerTiers, PageMover
from kvchat.engine.cache.page_hash import page_hash
from kvchat.engine.cache.page_records import Page, SeqPages
from kvchat.engine.cache.page_table_invariants import PageTableCorrupt, page_table_problems
from kvchat.engine.cache.page_table_views import PageInfo, PageTableStats, Reservation
from kvchat.engine.cache.prefix_index import PrefixIndex, PrefixMatch
from kvchat.engine.cache.state_snapshots import StateSnapshots
from kvchat.engine.cache.window_slots import WindowSlots
from kvchat.engine.events import CachedTokens
from kvchat.engine.per_tier import PerTier
from kvchat.engine.stats import Residency, TierPages
from kvchat.engine.tiers.host_tier import HostTier


class PageTable:
    """Device pages of one KV pool: allocation, prefix sharing, eviction, lower tiers, defrag.

    When no page is free, cached pages are evicted in the order `eviction` gives
    (orphans, pages only type-aheads computed, then whole trees by least-recently-used
    root, deepest page first). Evicting a full indexed page hands it to the lower
    tiers (`LowerTiers.keep`: the host tier, else disk); a partial page is dropped.
    Referenced pages are never victims. A released sequence's full pages go to disk too.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        salt: bytes,
        host: HostTier | None,
        mover: PageMover,
        disk: DiskStore | None = None,
        window: WindowSlots | None = None,
        *,
        states: StateSnapshots | None = None,
        host_states: int | None = None,
    ) -> None:
        """`window`: where the model keeps its windowed layers apart, which pages keep
        their part of them (`window_slots`); None: every layer of every page is kept.
        `states`: a hybrid model's linear-layer states kept at page ends
        (`state_snapshots`): a prefix is used up to the last page with one; the host
        tier keeps at most `host_states` of them (None: as many as the device)."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.salt = salt
        self._mover = mover
        self._pages = [Page(i) for i in range(num_pages)]
        self._free = FreePages(range(num_pages))  # lowest page first, so pages stay packed
        self._cached: set[int] = set()  # refcount 0, holding content
        self._index = PrefixIndex(self._pages, page_size)
        self._seqs: dict[int, SeqPages] = {}
        self._clock = 0  # logical: one tick per operation
        self._counters = CacheCounters()
        self._window = window
        self.states = states
        self._tiers = LowerTiers(
            host,
            disk,
            mover,
            anchored=self._anchored,
            count=self._count_eviction,
            window_of=window.has if window is not None else None,
            state_of=self._state_of if states is not None else None,
            states_capacity=0
            if states is None
            else states.capacity
            if host_states is None
            else host_states,
        )

    @property
    def host(self) -> HostTier | None:
        return self._tiers.host

    @property
    def disk(self) -> DiskStore | None:
        return self._tiers.disk

    # ---- admission -----------------------------------------------------------------------

    def reserve(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        *,
        count_as: Literal["prompt", "recompute", "type_ahead"],
    ) -> Reservation | None:
        """Admit a sequence whose K/V must cover `token_ids`; None (no change) if it cannot fit.

        Full pages are matched by hash (shared on the device, else restored from the
        host or disk tier), then the longest matching prefix of a page under the last
        matched hash is reused as the tail. At most `len(token_ids) - 1` tokens count as
        cached: the engine must compute at least the last one to get its logits.

        A type-ahead (`count_as="type_ahead"`) gets no slot for a generated token, counts in no
        prompt counter, and marks what it writes as a type-ahead's (`commit`); a prompt's
        reservation takes such pages over as its own and counts them in `cached_type_ahead`.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already live")
        if count_as not in ("prompt", "recompute", "type_ahead"):
            raise ValueError(
                f"count_as must be 'prompt', 'recompute' or 'type_ahead', got {count_as!r}"
            )
        is_type_ahead = count_as == "type_ahead"
        tokens = tuple(map(int, token_ids))
        n = len(tokens)
        if n == 0:
            raise ValueError("a sequence needs at least one token")
        window = self._window
        if window is not None and not window.admits(len(self._seqs) + 1):
            return None  # its window could not be held beside the live ones': it waits
        plan = plan_admission(
            tokens,
            is_type_ahead,
            salt=self.salt,
            index=self._index,
            tiers=self._tiers,
            can_allocate=self._can_allocate,
            can_take_over=self._can_take_over,
            window_cut=self._window_cut if window is not None else self._states_cut,
        )
        if plan is None:
            return None
        walk, ps = plan.walk, self.page_size
        self._clock += 1
        clock = self._clock
        cached_type_ahead = 0
        for p in plan.device_hits:  # pinned first: making room below never evicts them
            if not is_type_ahead:
                cached_type_ahead += self._take_from_type_ahead(p, ps)
            self._ref(p, clock)
        matched = len(walk.chain) * ps + walk.tail_len
        window_from = window.first_page(matched) if window is not None else 0
        if window is not None:  # held before any slot is given below, which could take them
            for j, (_, p) in enumerate(walk.chain):
                if p is not None and j >= window_from:
                    window.ref(p)
            if walk.tail_src is not None and window.has(walk.tail_src):
                window.ref(walk.tail_src)  # the tail's source (or the page extended)
        # a hybrid model's state where it resumes, if only the host has it: read before
        # making room, whose evictions bring states to the host and may push it out
        host_resume_state = None
        if self.states is not None and walk.chain and walk.chain[-1][1] is None:
            host_resume_state = self._tiers.state_on_host(walk.chain[-1][0])
        if plan.takeover:
            self._cached.discard(plan.after)  # this sequence extends it in place
        fresh = iter(
            self._allocate(plan.fresh, _opt(walk.tail_src), plan.protect_host, after=plan.after)
        )

        pages: list[int] = []
        on_device = on_host = on_disk = 0
        parent = self.salt
        for h, p in walk.chain:  # one case per full page
            if p is not None:  # a device hit, pinned above
                on_device += ps
            elif h in plan.from_disk:  # read back from the disk tier
                p = next(fresh)
                if window is not None:
                    has_part = self._mover.window_of_parts(plan.from_disk[h])
                    self._restore_window(p, has_part, held=len(pages) >= window_from)
                if self.states is not None and (len(pages) + 1) * ps == matched:
                    state = self._tiers.state_in_parts(plan.from_disk[h])  # where it resumes
                    if state is not None:
                        self.states.put(p, state)
                self._tiers.restore_from_disk(plan.from_disk[h], p)
                start = len(pages) * ps
                self._index_restored(p, h, parent, tokens[start : start + ps], clock)
                self._pages[p].refcount = 1
                on_disk += ps
            else:  # restored from the host tier
                p = next(fresh)
                if window is not None:
                    has_part = self._tiers.window_on_host(h)
                    self._restore_window(p, has_part, held=len(pages) >= window_from)
                if host_resume_state is not None and (len(pages) + 1) * ps == matched:
                    self.states.put(p, host_resume_state)  # type: ignore[union-attr]
                entry = self._tiers.restore_from_host(h, p, clock)
                self._index_restored(p, h, entry.parent, entry.tokens, clock)
                self._pages[p].refcount = 1
                on_host += ps
            pages.append(p)
            parent = h
        reused_tail = 0
        if walk.tail_len:
            p, reused_tail, tail_host, tail_type_ahead = self._reserve_tail(
                plan, fresh, tokens[len(pages) * ps :], parent, clock, is_type_ahead
            )
            on_device += reused_tail
            on_host += tail_host
            cached_type_ahead += tail_type_ahead
            pages.append(p)
        for p in fresh:  # the pages to compute
            self._pages[p].refcount = 1
            self._pages[p].last_used = clock
            pages.append(p)

        found = CachedTokens(on_device, on_host, on_disk)
        seq = self._seqs[seq_id] = SeqPages(pages, found.total, is_type_ahead)
        if self.states is not None and found.total:  # resumes after its last page's state
            seq.resume_state = self.states.get(pages[found.total // ps - 1])
        if window is not None:
            seq.window_from, seq.window_to = window_from, -(-matched // ps)
        if count_as == "prompt":
            self._counters = self._counters.prompt_admitted(n, found, cached_type_ahead)
        elif count_as == "recompute":
            self._counters = self._counters.plus(recomputed_tokens=n - found.total)
        return Reservation(seq_id, tuple(pages), found, reused_tail, found.total, cached_type_ahead)

    def _reserve_tail(
        self,
        plan: Admission,
        fresh: Any,
        rest: tuple[int, ...],
        parent: bytes,
        clock: int,
        is_type_ahead: bool,
    ) -> tuple[int, int, int, int]:
        """Reuse the walk's tail: extend the cached partial page, copy its tokens into a fresh
        page, or restore a host page's first tokens. `rest` are the tokens after the full
        pages. Returns the page and its tokens from the device, from the host, from type-aheads."""
        walk = plan.walk
        m = walk.tail_len
        p = walk.tail_src if plan.takeover else next(fresh)
        assert p is not None
        page = self._pages[p]
        on_device = on_host = from_type_ahead = 0
        if plan.takeover:
            page.last_used = clock  # already holds exactly the matched tokens
            on_device = m
            if not is_type_ahead:
                from_type_ahead = self._take_from_type_ahead(p, m)
        elif walk.tail_src is not None:
            src = self._pages[walk.tail_src]
            window = self._window
            src_window = window is not None and window.has(walk.tail_src)
            if src_window:
                self._hold_window(p, True)
            self._mover.copy_tokens(walk.tail_src, p, m)
            if window is not None and src_window:
                window.unref(walk.tail_src)  # held while its part was copied
            page.tokens = src.tokens[:m]
            src.last_used = clock
            on_device = m
            guessed = src.type_ahead_from is not None and src.type_ahead_from < m
            if guessed and is_type_ahead:  # the copy is as much a guess as its source
                page.type_ahead_from = src.type_ahead_from
            elif guessed:
                from_type_ahead = m - (src.type_ahead_from or 0)
        else:
            assert walk.tail_host is not None
            if self._window is not None:
                self._hold_window(p, self._tiers.window_on_host(walk.tail_host))
            self._tiers.restore_from_host(walk.tail_host, p, clock)
            page.tokens = list(rest[:m])
            on_host = m
        page.parent = parent
        self._index.add_child(parent, p)
        page.refcount = 1
        page.last_used = clock
        return p, on_device, on_host, from_type_ahead

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

        A page that becomes full gets its hash and joins the index, unless another page
        holds that hash (two sequences computed the same prefix at once): the indexed
        one stays, this one is freed when its sequence ends.
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
        if seq.type_ahead:
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
            if seq.type_ahead and page.type_ahead_from is None:
                page.type_ahead_from = len(page.tokens)
            page.tokens.extend(token_ids[done : done + take])
            page.last_used = self._clock
            done += take
            seq.num_tokens += take
            if len(page.tokens) == ps:
                assert page.parent is not None
                page.hash = page_hash(page.parent, page.tokens)
                if self._index.add_full(page.hash, p) or self._window_replaces(p):
                    self._drop_dominated_siblings(p)
                else:
                    self._hand_state_over(p)
        if self._window is not None:  # pages behind its next query's window: no longer its
            upto = min(self._window.first_page(seq.num_tokens), seq.window_to)
            for j in range(seq.window_from, upto):
                self._window.unref(seq.pages[j])
            seq.window_from = max(seq.window_from, upto)

    def release(self, seq_id: int) -> None:
        """End a sequence: its full pages stay as the prompt cache, its partial page as a tail."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not live")
        self._clock += 1
        if self._window is not None:
            for j in range(seq.window_from, seq.window_to):
                self._window.unref(seq.pages[j])
        full = seq.num_tokens // self.page_size
        if self.states is not None and full and not seq.type_ahead:
            self.states.mark_resume(seq.pages[full - 1])  # where this conversation resumes
        if self.disk is not None and not seq.type_ahead:  # a type-ahead's guesses: not kept
            self._tiers.save_released(self._indexed_chain(seq.pages))
        for p in reversed(seq.pages):
            page = self._pages[p]
            page.refcount -= 1
            page.last_used = self._clock
            if page.refcount == 0:
                self._settle(p)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seq(seq_id).pages)

    def window_pages(self, seq_id: int, end: int) -> tuple[int, ...]:
        """The sequence's pages as the windowed layers' store reads them (each page's
        window slot), after giving a slot to each page up to position `end` (exclusive)
        that has none: a step is about to write there. The table must have a window."""
        window = self._window
        assert window is not None, "this table keeps every layer of every page"
        seq = self._seq(seq_id)
        upto = min(-(-end // self.page_size), len(seq.pages))
        for j in range(seq.window_to, upto):
            self._hold_window(seq.pages[j], True)
        seq.window_to = max(seq.window_to, upto)
        return window.slots_of(seq.pages)

    @property
    def window(self) -> WindowSlots | None:
        return self._window

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def is_live(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    # ---- cache queries and upkeep --------------------------------------------------------

    def residency(self, token_ids: Sequence[int]) -> Residency:
        """Where this token history's K/V is, without changing any state (not even the clock).

        With windowed layers apart, what lies past the point where a switch would have to
        start again (its window let go) counts as nowhere: it would be computed. Pages only
        the disk holds are taken to have their part (their files are not read here)."""
        tokens = tuple(token_ids)
        walk = self._usable_walk(tokens)
        ps = self.page_size
        device = sum(ps for _, p in walk.chain if p is not None) + walk.tail_len
        lower = [h for h, p in walk.chain if p is None]
        host = sum(ps for h in lower if self._tiers.on_host(h))
        disk = len(lower) * ps - host
        return Residency(device, host, disk, nowhere=len(tokens) - device - host - disk)

    def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring back to the device the pages of this history that only the host or disk holds.

        They become unreferenced cached device pages, so the next `reserve` of this
        history finds them on the device. Only free pages and evictable cached pages
        of other chains are used. Returns the number of pages restored.
        """
        tokens = tuple(token_ids)
        ps = self.page_size
        while True:  # again when a disk page failed its checks (it is gone now)
            walk = self._usable_walk(tokens)
            on_device = {p for _, p in walk.chain if p is not None}
            k = min(
                sum(1 for _, p in walk.chain if p is None),
                len(self._free) + len(self._cached - on_device),
            )
            if k == 0:
                return 0
            # the first k pages not on the device, each with its parent and tokens
            wanted: list[tuple[bytes, bytes, tuple[int, ...]]] = []
            parent = self.salt
            for i, (h, p) in enumerate(walk.chain):
                if p is None and len(wanted) < k:
                    wanted.append((h, parent, tokens[i * ps : (i + 1) * ps]))
                parent = h
            from_disk = self._tiers.read_disk_only([h for h, _, _ in wanted])
            if from_disk is not None:
                break
        self._clock += 1
        clock = self._clock
        for p in on_device:
            self._pages[p].last_used = clock
        fresh = self._allocate(k, on_device, {h for h, _ in walk.chain})
        window = self._window
        # the pages a switch to this history reads with its windowed layers: their parts
        # come back even if idle parts of others must make room, the rest while slots are free
        window_from = window.first_page(len(tokens) - 1) if window is not None else 0
        for i, ((h, parent, page_tokens), p) in enumerate(zip(wanted, fresh, strict=True)):
            if h in from_disk:
                if window is not None and self._mover.window_of_parts(from_disk[h]):
                    self._keep_window_idle(p, let_go=i >= window_from)
                state = self._tiers.state_in_parts(from_disk[h])
                if state is not None:
                    self.states.put(p, state)  # type: ignore[union-attr]
                self._tiers.restore_from_disk(from_disk[h], p)
                self._index_restored(p, h, parent, page_tokens, clock)
            else:
                if window is not None and self._tiers.window_on_host(h):
                    self._keep_window_idle(p, let_go=i >= window_from)
                state = self._tiers.state_on_host(h) if self.states is not None else None
                if state is not None:
                    self.states.put(p, state)  # type: ignore[union-attr]
                entry = self._tiers.restore_from_host(h, p, clock)
                self._index_restored(p, h, entry.parent, entry.tokens, clock)
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
        window = self._window.usage() if self._window is not None else None
        return PageTableStats(PerTier(device, host, TierPages()), self._counters, window)

    def page_info(self, index: int) -> PageInfo:
        return PageInfo.of(self._pages[index], indexed=self._index.is_indexed(index))

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
        out.extend(self._tiers.problems())
        if self._window is not None:
            out.extend(self._window.problems())
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
        """Empty a cached page: a full indexed page goes to the lower tiers, others are dropped."""
        page = self._pages[p]
        h = page.hash
        if h is not None and self._index.get(h) == p:
            assert page.parent is not None
            self._tiers.keep(h, page.parent, tuple(page.tokens), p, page.last_used, protect_host)
        else:
            self._count_eviction("device_dropped")
        self._clear(p)

    def _count_eviction(self, kind: EvictionKind) -> None:
        self._counters = self._counters.eviction(kind)

    def _indexed_chain(self, pages: list[int]) -> list[tuple[bytes, bytes, tuple[int, ...], int]]:
        """A sequence's leading full, indexed pages: hash, parent, tokens, device page."""
        out = []
        for p in pages:  # the chain's full, indexed pages come first
            if not self._index.is_indexed(p):
                break
            page = self._pages[p]
            out.append((page.hash, page.parent, tuple(page.tokens), p))
        return out

    def _index_restored(
        self, p: int, h: bytes, parent: bytes, tokens: Sequence[int], clock: int
    ) -> None:
        """Device page `p` now holds page `h` copied back from a lower tier: index it."""
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
        if self._window is not None:
            self._window.drop(p)
        if self.states is not None:
            self.states.drop(p)
        page.hash = None
        page.parent = None
        page.tokens = []
        page.last_used = 0
        page.type_ahead_from = None

    def _take_from_type_ahead(self, p: int, matched: int) -> int:
        """A turn uses page `p`'s first `matched` slots: no longer a guess. Returns the
        type-ahead's tokens among them."""
        page = self._pages[p]
        start = page.type_ahead_from
        if start is None:
            return 0
        page.type_ahead_from = None
        return max(0, matched - start)

    def _ref(self, p: int, clock: int) -> None:
        page = self._pages[p]
        if page.refcount == 0:
            self._cached.discard(p)
        page.refcount += 1
        page.last_used = clock

    def _settle(self, p: int) -> None:
        """A page's last holder let go: keep it as cache if it can be matched, else free it."""
        page = self._pages[p]
        if not page.tokens:
            if self._window is not None:  # a step was to write it, and failed
                self._window.drop(p)
            self._free.push(p)
            return
        if len(page.tokens) == self.page_size:
            assert page.hash is not None
            if self._index.get(page.hash) != p:  # a duplicate of an indexed page: nothing to keep
                self._clear(p)
                self._free.push(p)
                return
        elif self._index.is_dominated(p, self._cached):
            self._clear(p)
            self._free.push(p)
            return
        self._cached.add(p)
        self._drop_dominated_siblings(p)

    def _drop_dominated_siblings(self, p: int) -> None:
        """Free cached partial pages whose tokens are a prefix of page `p`'s: `p` matches better."""
        for q in self._index.dominated_siblings(p, self._cached):
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
        if self._window is not None:
            self._window.moved(src, dst)
        if self.states is not None:
            self.states.moved(src, dst)

    # ---- the windowed layers' parts ------------------------------------------------------

    def _hold_window(self, p: int, give: bool) -> None:
        """The sequence being admitted or stepped reads page `p`'s window part: give it a
        slot first when `give` (a part is about to be written or copied there)."""
        assert self._window is not None
        if give and not self._window.has(p):
            self._window.give(p)
        if self._window.has(p):
            self._window.ref(p)

    def _keep_window_idle(self, p: int, *, let_go: bool) -> None:
        """A restored page's window part comes back too, as cache: in a free slot, or
        (`let_go`) in the longest idle part's."""
        assert self._window is not None
        if self._window.has_free() or (let_go and self._window.can_give()):
            self._window.give(p)

    def _restore_window(self, p: int, has_part: bool, *, held: bool) -> None:
        """A page an admitted sequence restores: within its window (`held`), its part
        comes back and is held; behind it, the part comes back idle while a slot is free
        (a fork of this history may need it)."""
        if held:
            self._hold_window(p, has_part)
        elif has_part:
            self._keep_window_idle(p, let_go=False)

    def _window_cut(
        self, walk: PrefixMatch, from_disk: dict[bytes, Any], *, unread_disk_kept: bool = False
    ) -> int:
        """The most tokens of `walk` a sequence can start from: every page of the window
        before its first new token must have its window part somewhere (the device, the
        host, or the disk page's file). Else the match ends at the last full page where
        that holds (at worst 0: computed from the start)."""
        window, ps, chain = self._window, self.page_size, walk.chain
        assert window is not None

        def kept(j: int) -> bool:
            if j < len(chain):
                h, p = chain[j]
                if p is not None:
                    return window.has(p)
                if h in from_disk:
                    return self._mover.window_of_parts(from_disk[h])
                if unread_disk_kept and not self._tiers.on_host(h):
                    return True
                return self._tiers.window_on_host(h)
            if walk.tail_src is not None:
                return window.has(walk.tail_src)
            return walk.tail_host is not None and self._tiers.window_on_host(walk.tail_host)

        def whole(end: int) -> bool:
            return all(kept(j) for j in range(window.first_page(end), -(-end // ps)))

        matched = len(chain) * ps + walk.tail_len
        if whole(matched):
            return matched
        return next((k * ps for k in range(len(chain), 0, -1) if whole(k * ps)), 0)

    def _usable_walk(self, tokens: tuple[int, ...]) -> PrefixMatch:
        """The walk of a whole history as far as a request could start from it: to its
        last page with a state (a hybrid model), or to where its window is whole (pages
        only the disk holds taken to have their part: their files are not read here)."""
        walk = self._index.walk(
            tokens, len(tokens), self.salt, self.host, host_tail=False, disk=self.disk
        )
        cut = self._states_cut
        if self._window is None and cut is None:
            return walk
        if cut is not None:
            start = cut(walk, {}, unread_disk_kept=True)
        else:
            start = self._window_cut(walk, {}, unread_disk_kept=True)
        if start < len(walk.chain) * self.page_size + walk.tail_len:
            walk = self._index.walk(
                tokens, start, self.salt, self.host, host_tail=False, disk=self.disk
            )
        return walk

    @property
    def _states_cut(self) -> Any:
        """For `plan_admission`, where the table keeps linear-layer states: a walk is
        usable up to its last device page that has its state (`state_snapshots`)."""
        states = self.states
        if states is None:
            return None

        def kept(h: bytes, p: int | None, from_disk: dict[bytes, Any], unread: bool) -> bool:
            if p is not None:
                return states.has(p)
            if self._tiers.on_host(h):
                return self._tiers.has_state_on_host(h)
            if h in from_disk:
                return self._tiers.state_in_parts(from_disk[h]) is not None
            return unread  # a page only the disk holds, its file not read

        def cut(
            walk: PrefixMatch, from_disk: dict[bytes, Any], *, unread_disk_kept: bool = False
        ) -> int:
            for k in range(len(walk.chain), 0, -1):
                h, p = walk.chain[k - 1]
                if kept(h, p, from_disk, unread_disk_kept):
                    return k * self.page_size
            return 0

        return cut

    def _hand_state_over(self, p: int) -> None:
        """Page `p` duplicates an indexed page: a state kept at `p`'s end goes to the
        indexed one if it has none (else a history cut back where its state was let go
        would be cut there again at every request, and a type-ahead never get past it)."""
        states, h = self.states, self._pages[p].hash
        q = self._index.get(h) if h is not None else None
        if states is not None and q is not None and states.has(p) and not states.has(q):
            states.put(q, states.get(p))

    def _state_of(self, page: int) -> Any:
        """The state kept at device page `page`'s end, or None (for the lower tiers)."""
        assert self.states is not None
        return self.states.get(page) if self.states.has(page) else None

    def keep_state(self, page: int, state: Any) -> None:
        """A step ended page `page` of a sequence: keep the linear layers' state there."""
        assert self.states is not None, "this table keeps no states"
        self.states.put(page, state)
        self._hand_state_over(page)  # the page may duplicate an indexed one already

    def resume_state(self, seq_id: int) -> Any:
        """The state an admitted sequence resumes from (at its cached prefix's end), once."""
        seq = self._seq(seq_id)
        state, seq.resume_state = seq.resume_state, None
        return state

    def _window_replaces(self, p: int) -> bool:
        """Page `p` just became full with the hash of a cached page that lost its window
        part: `p`, which has one, takes its place in the index (else a conversation that
        had to recompute its window would have to again at every switch)."""
        window, page = self._window, self._pages[p]
        assert page.hash is not None
        q = self._index.get(page.hash)
        if window is None or q is None or q == p or not window.has(p) or window.has(q):
            return False
        if self._pages[q].refcount:
            return False
        self._clear(q)  # the index's duplicate `p` takes over
        self._free.push(q)
        return self._index.get(page.hash) == p


def _opt(x: int | bytes | None) -> set:
    return set() if x is None else {x}
