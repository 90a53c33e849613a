"""Randomized operation sequences against the page table, checking invariants after each step.

Tiny pools (page size 4, 4-16 device pages, 0-8 host slots, a disk tier or not) and a three-token
alphabet make prefixes collide, pages evict and chains break all the time. After
every step `validate()` must hold, and the fake K/V store must agree with the
table: every live sequence's pages hold exactly its token prefixes, and every
cached device page, host slot and disk page holds the prefixes its hash names.
That proves the data followed the pages through evictions, restores, tail copies,
moves, disk reads, restarts and disk pages that fail their checks.
"""

from __future__ import annotations

from operator import attrgetter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.tiers.host_tier import HostTier
from tests.disk_helpers import DiskMover, FakeDisk
from tests.page_table_helpers import PS, SALT, assert_data, chain_hash

MONOTONIC = (
    "evictions.device_to_host",
    "evictions.host_dropped",
    "evictions.device_dropped",
    "prompt_tokens",
    "cached_tokens.device",
    "cached_tokens.host",
    "prefilled_tokens",
    "recomputed_tokens",
    "cached_tokens.disk",
    "evictions.host_to_disk",
    "device_to_disk",
)
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def has_live(m: PageTableMachine) -> bool:
    return bool(m.tokens)


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # live sequence -> every token it will hold
        self.histories: list[list[int]] = [[0, 1, 2, 0, 1]]  # released conversations
        self.counters = [0] * len(MONOTONIC)

    @initialize(
        num_pages=st.integers(4, 16),
        host_slots=st.none() | st.integers(0, 8),
        disk_pages=st.none() | st.integers(0, 12),
    )
    def setup(self, num_pages: int, host_slots: int | None, disk_pages: int | None) -> None:
        self.shape = (num_pages, host_slots)
        self.disk = None if disk_pages is None else FakeDisk(capacity=disk_pages)
        self._new_table()

    def _new_table(self) -> None:
        num_pages, host_slots = self.shape
        self.mover = DiskMover(num_pages, host_slots or 0)
        host = None if host_slots is None else HostTier(host_slots)
        self.table = PageTable(num_pages, PS, SALT, host, self.mover, self.disk)

    def _compute(self, sid: int, upto: int) -> None:
        """Write and commit K/V for the sequence's tokens up to `upto` (as the engine does)."""
        start = self.table.num_tokens(sid)
        pages = self.table.pages(sid)
        toks = self.tokens[sid]
        for pos in range(start, upto):
            self.mover.dev[pages[pos // PS]][pos % PS] = tuple(toks[: pos + 1])
        self.table.commit(sid, toks[start:upto])

    def _pick(self, pick: int) -> int:
        return sorted(self.tokens)[pick % len(self.tokens)]

    def _admit(self, toks: list[int], count_as: str, chunk: int) -> int | None:
        sid = self.next_id
        self.next_id += 1
        before = self.table.stats()
        res = self.table.reserve(sid, toks, count_as=count_as)  # type: ignore[arg-type]
        if res is None:
            assert self.table.stats() == before
            return None
        n = len(toks)
        assert res.to_compute_from == res.cached.device + res.cached.host + res.cached.disk <= n - 1
        assert res.reused_tail <= res.cached.device
        assert len(res.pages) * PS >= n + 1 and len(set(res.pages)) == len(res.pages)
        self.tokens[sid] = list(toks)
        assert_data(self.table, self.mover, sid, toks)  # the cached part is already right
        self._compute(sid, min(n, res.to_compute_from + chunk))  # a first prefill chunk
        return sid

    @rule(new=TOKENS, base=st.integers(0, 50), chunk=st.integers(1, 14))
    def new_turn(self, new: list[int], base: int, chunk: int) -> None:
        """A new turn: a previous conversation's tokens (or nothing) plus new ones."""
        history = self.histories[base % len(self.histories)][:24] if base % 3 else []
        self._admit(history + new, "prompt", chunk)

    @rule(pick=st.integers(0, 50), new=TOKENS, chunk=st.integers(1, 14))
    def switch_back(self, pick: int, new: list[int], chunk: int) -> None:
        """Return to a conversation that was pushed out to the host tier, if there is one."""
        pushed = [h for h in self.histories if self.table.residency(h[:24]).host]
        history = (pushed or self.histories)[pick % len(pushed or self.histories)][:24]
        self._admit(history + new[:2], "prompt", chunk)

    @precondition(has_live)
    @rule(pick=st.integers(0, 50), chunk=st.integers(1, 14))
    def prefill(self, pick: int, chunk: int) -> None:
        sid = self._pick(pick)
        n = self.table.num_tokens(sid)
        self._compute(sid, min(len(self.tokens[sid]), n + chunk))

    @precondition(has_live)
    @rule(pick=st.integers(0, 50), token=st.integers(0, 2))
    def decode(self, pick: int, token: int) -> None:
        sid = self._pick(pick)
        toks = self.tokens[sid]
        if self.table.num_tokens(sid) < len(toks):
            self._compute(sid, len(toks))  # finish the prompt first
        if self.table.ensure_capacity(sid, len(toks) + 1):
            toks.append(token)
            self._compute(sid, len(toks))
        else:
            assert len(self.table.pages(sid)) * PS < len(toks) + 1

    @precondition(has_live)
    @rule(pick=st.integers(0, 50))
    def release(self, pick: int) -> None:
        self._release(self._pick(pick))

    @rule(max_moves=st.none() | st.integers(1, 4), resuming=st.booleans())
    def go_idle_and_defragment(self, max_moves: int | None, resuming: bool) -> None:
        """Every conversation ends; the engine defragments while idle, in slices when resuming."""
        for sid in sorted(self.tokens):
            self._release(sid)
        moved = self.table.defragment(max_moves, resuming=resuming)
        assert moved <= (max_moves if max_moves is not None else 2 * self.table.num_pages)

    def _release(self, sid: int) -> None:
        written = self.tokens.pop(sid)[: self.table.num_tokens(sid)]
        self.table.release(sid)
        if written:
            self.histories.append(written)

    @precondition(has_live)
    @rule(pick=st.integers(0, 50), chunk=st.integers(1, 14))
    def preempt_and_readmit(self, pick: int, chunk: int) -> None:
        sid = self._pick(pick)
        toks = self.tokens.pop(sid)[: max(1, self.table.num_tokens(sid))]
        self.table.release(sid)
        self._admit(toks, "recompute", chunk)

    @rule(pick=st.integers(0, 50), extra=st.lists(st.integers(0, 2), max_size=5))
    def residency_changes_nothing(self, pick: int, extra: list[int]) -> None:
        toks = self.histories[pick % len(self.histories)] + extra
        before = self._snapshot()
        r = self.table.residency(toks)
        assert r.device + r.host + r.disk + r.nowhere == len(toks)
        assert min(r.device, r.host, r.disk, r.nowhere) >= 0
        assert self._snapshot() == before

    @rule(pick=st.integers(0, 50))
    def prefetch(self, pick: int) -> None:
        pushed = [h for h in self.histories if self.table.residency(h).host]
        toks = (pushed or self.histories)[pick % len(pushed or self.histories)]
        before = self.table.residency(toks)
        restored = self.table.prefetch(toks)
        assert 0 <= restored * PS <= before.host + before.disk

    @precondition(lambda m: m.disk is not None)
    @rule()
    def restart(self) -> None:
        """kvchat quits and starts again: only the disk tier keeps anything."""
        for sid in sorted(self.tokens):
            self._release(sid)
        self._new_table()
        self.counters = [0] * len(MONOTONIC)

    @precondition(lambda m: m.disk is not None and bool(m.disk.pages))
    @rule(pick=st.integers(0, 50))
    def a_disk_page_fails_its_checks(self, pick: int) -> None:
        assert self.disk is not None
        self.disk.broken.add(sorted(self.disk.pages)[pick % len(self.disk.pages)])

    @rule(max_moves=st.none() | st.integers(1, 4))
    def defragment(self, max_moves: int | None) -> None:
        moved = self.table.defragment(max_moves)
        if self.tokens:
            assert moved == 0
        if max_moves is not None:
            assert moved <= max_moves

    def _snapshot(self) -> object:
        t = self.table
        host = sorted((p.hash, p.slot, p.last_used) for p in t.host.pages()) if t.host else None
        pages = [t.page_info(p) for p in range(t.num_pages)]
        return t.stats(), pages, host, len(self.mover.calls), t._clock

    @invariant()
    def table_is_sound_and_data_followed_pages(self) -> None:
        if not hasattr(self, "table"):
            return
        t = self.table
        t.validate()
        for sid, toks in self.tokens.items():
            assert_data(t, self.mover, sid, toks)
        for p in range(t.num_pages):  # every page with content holds what its chain names
            info = t.page_info(p)
            if not info.tokens:
                continue
            for j, tok in enumerate(info.tokens):
                prefix = self.mover.dev[p][j]
                assert prefix is not None and prefix[-1] == tok, f"page {p} slot {j}: {prefix}"
                assert chain_hash(prefix[: len(prefix) - j - 1]) == info.parent
        if t.host is not None:
            for hp in t.host.pages():
                slot = self.mover.host[hp.slot]
                assert tuple(s[-1] for s in slot if s) == hp.tokens
                assert chain_hash(slot[-1] or ()) == hp.hash
        if self.disk is not None:
            for h, (parent, tokens, parts) in self.disk.pages.items():
                assert tuple(s[-1] for s in parts) == tokens
                assert chain_hash(parts[-1][:-PS]) == parent and chain_hash(parts[-1]) == h
        s = t.stats()
        assert (
            s.counters.prompt_tokens == s.counters.cached_tokens.total + s.counters.prefilled_tokens
        )
        counters = [attrgetter(f)(s.counters) for f in MONOTONIC]
        assert all(a >= b for a, b in zip(counters, self.counters, strict=True)), "counter fell"
        self.counters = counters
        assert (
            s.pages.device.active + s.pages.device.cached + s.pages.device.free
            == s.pages.device.capacity
        )


PageTableMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_page_table_random = PageTableMachine.TestCase
