"""Randomized operation sequences against a page table whose windowed layers are kept apart.

Like `test_page_table_random`, with a bounded `WindowSlots` (fewer usable slots than
device pages), a window of 5-7 tokens, pages of 4 and steps of 4-8 tokens, so parts are
let go, matches are cut back to where the window is whole and windows come back from
the host tier and the disk all the time. The engine is played as it runs: a step's
sequences get their pages (`ensure_capacity`) and their window slots (`window_pages`)
before anything is written, both stores are written, then each run is committed.

After every step `validate()` must hold and the fake stores must agree with the table:
every live sequence's pages hold its token prefixes, every position its next query reads
has its prefix in that page's window slot, every kept window part (device, host, disk)
holds its page's prefixes, and live sequences hold no window parts but their windows'.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.cache.window_slots import UNKEPT, WindowSlots
from kvchat.engine.tiers.host_tier import HostTier
from tests.disk_helpers import FakeDisk, WindowDiskMover
from tests.page_table_helpers import PS, SALT, assert_data, chain_hash

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=24)
CHUNKS = st.just(-1) | st.integers(0, 8)  # what the first step computes; -1: all of it
MAX_TOKENS = 40  # a sequence's tokens, at most: up to 10 pages


def has_live(m: WindowTableMachine) -> bool:
    return bool(m.tokens)


class WindowTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}  # live sequence -> every token it will hold
        self.histories: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1, 2]]  # released ones

    @initialize(
        window=st.integers(5, 7),
        chunk=st.integers(4, 8),
        more_pages=st.integers(0, 10),
        extra_slots=st.integers(0, 4),
        host_slots=st.sampled_from([None, 0, 2, 4, 6, 8, 12]),
        disk_pages=st.sampled_from([None, 0, 4, 8, 16, 32]),
    )
    def setup(
        self,
        window: int,
        chunk: int,
        more_pages: int,
        extra_slots: int,
        host_slots: int | None,
        disk_pages: int | None,
    ) -> None:
        per_sequence = -(-(window - 1) // PS) + 2
        per_step = -(-chunk // PS) + 1
        fewest = 2 * per_sequence + per_step + 1  # two live sequences' windows and a step
        num_pages = fewest + more_pages
        slots = min(num_pages, fewest + extra_slots)  # slot 0 is never given: < a slot a page
        self.shape = (window, chunk, num_pages, slots, host_slots)
        self.window_len, self.chunk = window, chunk
        self.disk = None if disk_pages is None else FakeDisk(capacity=disk_pages)
        self._new_table()

    def _new_table(self) -> None:
        window, chunk, num_pages, slots, host_slots = self.shape
        self.window = WindowSlots(slots, window, PS, chunk, num_pages)
        assert not self.window.unbounded
        self.mover = WindowDiskMover(num_pages, host_slots or 0, self.window)
        host = None if host_slots is None else HostTier(host_slots)
        self.table = PageTable(num_pages, PS, SALT, host, self.mover, self.disk, self.window)

    # ---- the engine's moves ----------------------------------------------------------------

    def _step(self, runs: list[tuple[int, int]]) -> None:
        """One engine step: each (sequence, tokens) run gets its pages and window slots,
        then both stores are written, then every run is committed."""
        t, mover = self.table, self.mover
        ends = {}
        for sid, k in runs:
            start = t.num_tokens(sid)
            ends[sid] = min(len(self.tokens[sid]), start + k)
            assert t.ensure_capacity(sid, ends[sid])  # reserve and decode gave them already
        slot_lists = {sid: t.window_pages(sid, ends[sid]) for sid, _ in runs}
        for sid, _ in runs:
            toks, pages, slots = self.tokens[sid], t.pages(sid), slot_lists[sid]
            for pos in range(t.num_tokens(sid), ends[sid]):
                prefix = tuple(toks[: pos + 1])
                ws = slots[pos // PS]
                assert ws != UNKEPT, f"sequence {sid} writes position {pos} with no window slot"
                mover.dev[pages[pos // PS]][pos % PS] = prefix
                mover.win[ws][pos % PS] = prefix
        for sid, _ in runs:  # what the step's queries read, from every run's first query on
            first = max(0, t.num_tokens(sid) - self.window_len + 1)
            self._assert_window(sid, first, ends[sid], t.window_pages(sid, ends[sid]))
        for sid, _ in runs:
            start = t.num_tokens(sid)
            t.commit(sid, self.tokens[sid][start : ends[sid]])

    def _assert_window(self, sid: int, first: int, end: int, slots: tuple[int, ...]) -> None:
        toks = self.tokens[sid]
        for pos in range(first, end):
            ws = slots[pos // PS]
            assert ws != UNKEPT, f"sequence {sid} reads position {pos}, whose part was let go"
            got = self.mover.win[ws][pos % PS]
            assert got == tuple(toks[: pos + 1]), f"sequence {sid} window position {pos}: {got}"

    def _chunk(self, chunk: int) -> int:
        return min(chunk, self.chunk)

    def _pick(self, pick: int) -> int:
        return sorted(self.tokens)[pick % len(self.tokens)]

    def _window_snapshot(self) -> object:
        w = self.window
        return dict(w._slot), dict(w._refs), list(w._idle), w.let_go

    def _admit(self, toks: list[int], count_as: str, chunk: int) -> int | None:
        toks = toks[-MAX_TOKENS:]
        sid = self.next_id
        self.next_id += 1
        before = self.table.stats(), self._window_snapshot()
        live = len(self.tokens)
        res = self.table.reserve(sid, toks, count_as=count_as)  # type: ignore[arg-type]
        if res is None:
            assert (self.table.stats(), self._window_snapshot()) == before
            if not self.tokens:
                return None
            self._release(min(self.tokens))  # it waits for the oldest to finish
            return self._admit(toks, count_as, chunk)
        assert self.window.admits(live + 1)
        n = len(toks)
        cached = res.to_compute_from
        assert cached == res.cached.total <= n - 1
        assert res.reused_tail <= res.cached.device
        assert len(res.pages) * PS >= n + 1 and len(set(res.pages)) == len(res.pages)
        assert self.table.num_tokens(sid) == cached
        self.tokens[sid] = list(toks)
        # the cached part is valid: its K/V and the window its first query reads
        assert_data(self.table, self.mover, sid, toks)
        slots = self.window.slots_of(self.table.pages(sid))
        self._assert_window(sid, max(0, cached - self.window_len + 1), cached, slots)
        if chunk < 0:  # the whole prompt, a chunk a step
            while self.table.num_tokens(sid) < n:
                self._step([(sid, self.chunk)])
        elif chunk:
            self._step([(sid, chunk)])  # a first prefill chunk
        return sid

    # ---- rules -----------------------------------------------------------------------------

    @rule(new=TOKENS, base=st.integers(0, 50), cut=st.integers(0, MAX_TOKENS), chunk=CHUNKS)
    def new_turn(self, new: list[int], base: int, cut: int, chunk: int) -> None:
        """A new conversation, or a fork of a released one at any point, plus new tokens."""
        history = self.histories[base % len(self.histories)][:cut] if base % 3 else []
        self._admit(history + new, "prompt", self._chunk(chunk))

    @rule(pick=st.integers(0, 50), new=TOKENS, chunk=CHUNKS)
    def continue_conversation(self, pick: int, new: list[int], chunk: int) -> None:
        """A released conversation's next turn: all its tokens, then the new ones."""
        history = self.histories[pick % len(self.histories)]
        self._admit(history + new[:4], "prompt", self._chunk(chunk))

    @rule(pick=st.integers(0, 50), new=TOKENS, chunk=CHUNKS)
    def switch_back(self, pick: int, new: list[int], chunk: int) -> None:
        """Return to a conversation pushed out to the host or disk tier, if there is one."""
        pushed = [
            h for h in self.histories if (r := self.table.residency(h[-MAX_TOKENS:])).host + r.disk
        ]
        history = (pushed or self.histories)[pick % len(pushed or self.histories)]
        self._admit(history + new[:2], "prompt", self._chunk(chunk))

    @precondition(has_live)
    @rule(
        picks=st.lists(st.integers(0, 50), min_size=1, max_size=3, unique=True),
        sizes=st.lists(st.integers(1, 8), min_size=3, max_size=3),
        sampled=st.lists(st.integers(0, 2), min_size=3, max_size=3),
    )
    def step(self, picks: list[int], sizes: list[int], sampled: list[int]) -> None:
        """One engine step over up to three live sequences, at most `chunk` tokens in all:
        a prompt's next chunk, or one generated token where the prompt is done."""
        runs: list[tuple[int, int]] = []
        budget = self.chunk
        for pick, k, token in zip(picks, sizes, sampled, strict=False):
            sid = self._pick(pick)
            if budget == 0 or any(sid == s for s, _ in runs):
                continue
            toks = self.tokens[sid]
            if self.table.num_tokens(sid) == len(toks):  # decode the sampled token
                if len(toks) >= MAX_TOKENS:
                    continue
                toks.append(token)
                if not self.table.ensure_capacity(sid, len(toks) + 1):
                    toks.pop()  # no page for it: the engine would preempt; here it waits
                    continue
                k = 1
            k = min(k, budget, len(toks) - self.table.num_tokens(sid))
            runs.append((sid, k))
            budget -= k
        if runs:
            self._step(runs)

    @precondition(has_live)
    @rule(pick=st.integers(0, 50))
    def release(self, pick: int) -> None:
        self._release(self._pick(pick))

    @precondition(has_live)
    @rule(pick=st.integers(0, 50), k=st.integers(1, 8), written=st.integers(0, 8))
    def a_step_fails(self, pick: int, k: int, written: int) -> None:
        """A step gets its window slots, writes part of its run, and fails: the sequence
        ends with nothing committed (its pages and slots past its tokens go back)."""
        sid = self._pick(pick)
        t, toks = self.table, self.tokens[sid]
        start = t.num_tokens(sid)
        end = min(len(toks), start + min(k, self.chunk))
        if end > start:
            assert t.ensure_capacity(sid, end)
            pages, slots = t.pages(sid), t.window_pages(sid, end)
            for pos in range(start, min(end, start + written)):
                self.mover.dev[pages[pos // PS]][pos % PS] = (-1,)  # never committed
                self.mover.win[slots[pos // PS]][pos % PS] = (-1,)
        self._release(sid)

    def _release(self, sid: int) -> None:
        written = self.tokens.pop(sid)[: self.table.num_tokens(sid)]
        self.table.release(sid)
        if written:
            self.histories.append(written)

    @precondition(has_live)
    @rule(pick=st.integers(0, 50), chunk=CHUNKS)
    def preempt_and_readmit(self, pick: int, chunk: int) -> None:
        sid = self._pick(pick)
        toks = self.tokens.pop(sid)[: max(1, self.table.num_tokens(sid))]
        self.table.release(sid)
        self._admit(toks, "recompute", self._chunk(chunk))

    @rule(max_moves=st.none() | st.integers(1, 4), resuming=st.booleans())
    def go_idle_and_defragment(self, max_moves: int | None, resuming: bool) -> None:
        """Every conversation ends; the engine defragments while idle, in slices when resuming."""
        for sid in sorted(self.tokens):
            self._release(sid)
        self.table.defragment(max_moves, resuming=resuming)

    @rule(pick=st.integers(0, 50))
    def prefetch(self, pick: int) -> None:
        pushed = [h for h in self.histories if (r := self.table.residency(h)).host + r.disk]
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

    @precondition(lambda m: m.disk is not None and bool(m.disk.pages))
    @rule(pick=st.integers(0, 50))
    def a_disk_page_fails_its_checks(self, pick: int) -> None:
        assert self.disk is not None
        self.disk.broken.add(sorted(self.disk.pages)[pick % len(self.disk.pages)])

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def table_is_sound_and_windows_followed_pages(self) -> None:
        if not hasattr(self, "table"):
            return
        t, mover, window = self.table, self.mover, self.window
        t.validate()
        held_at_most = 0
        for sid, toks in self.tokens.items():
            assert_data(t, mover, sid, toks)
            n = t.num_tokens(sid)
            pages = t.pages(sid)
            self._assert_window(sid, max(0, n - self.window_len + 1), n, window.slots_of(pages))
            for p in pages[window.first_page(n) : -(-n // PS)]:  # held, not idle
                assert window.has(p) and p not in window._idle, f"sequence {sid} page {p}"
            held_at_most += -(-n // PS) - window.first_page(n)
        assert window.in_use - window.idle <= held_at_most, "a part no window covers is held"
        for p in range(t.num_pages):  # every page with content holds what its chain names
            info = t.page_info(p)
            ws = window.slot(p)
            if not info.tokens:
                continue
            for j, tok in enumerate(info.tokens):
                prefix = mover.dev[p][j]
                assert prefix is not None and prefix[-1] == tok, f"page {p} slot {j}: {prefix}"
                assert chain_hash(prefix[: len(prefix) - j - 1]) == info.parent
                if ws is not None:  # its window part holds the same prefixes
                    assert mover.win[ws][j] == prefix, f"page {p} window slot {ws} [{j}]"
        if t.host is not None:
            for hp in t.host.pages():
                slot = mover.host[hp.slot]
                assert tuple(s[-1] for s in slot if s) == hp.tokens
                assert chain_hash(slot[-1] or ()) == hp.hash
                part = mover.host_win[hp.slot]
                assert part is None or part == slot, f"host slot {hp.slot}'s window part"
        if self.disk is not None:
            for h, (parent, tokens, (full, part)) in self.disk.pages.items():
                assert tuple(s[-1] for s in full) == tokens
                assert chain_hash(full[-1][:-PS]) == parent and chain_hash(full[-1]) == h
                assert part is None or part == full, "a disk page's window part"


WindowTableMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_page_table_window_random = WindowTableMachine.TestCase
