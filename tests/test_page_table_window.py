"""The page table of a model whose windowed layers are kept apart (`WindowSlots`).

A live sequence holds the window part of the pages its next query reads and no other;
what it let go stays as idle cache until a slot is wanted; a conversation resumed at its
end finds its window (on the device or restored from the host) and computes only what is
new; a match whose window was let go ends where the window is whole. The fake mover keeps
each window slot's "K/V" (the prefix that made it), so a part in the wrong slot shows.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.cache.window_slots import UNKEPT, WindowSlots
from kvchat.engine.tiers.host_tier import HostTier
from tests.disk_helpers import FakeDisk, WindowDiskMover
from tests.page_table_helpers import PS, SALT, WindowFakeMover, assert_data

WINDOW = 6  # a query reads itself and 5 positions back: 2 or 3 pages of 4
CHUNK = 8  # tokens a step writes at most


def make(num_pages: int, slots: int, host_slots: int | None = None):
    window = WindowSlots(slots, WINDOW, PS, CHUNK, num_pages)
    mover = WindowFakeMover(num_pages, host_slots or 0, window)
    host = None if host_slots is None else HostTier(host_slots)
    return PageTable(num_pages, PS, SALT, host, mover, None, window), mover, window


def compute(table: PageTable, mover: WindowFakeMover, seq_id: int, tokens: Sequence[int]) -> None:
    """Play the engine a step at a time: window slots for what the step writes, both
    stores written, then the commit."""
    while (start := table.num_tokens(seq_id)) < len(tokens):
        end = min(len(tokens), start + CHUNK)
        assert table.ensure_capacity(seq_id, end)
        pages = table.pages(seq_id)
        slots = table.window_pages(seq_id, end)
        for pos in range(start, end):
            prefix = tuple(tokens[: pos + 1])
            mover.dev[pages[pos // PS]][pos % PS] = prefix
            assert slots[pos // PS] != UNKEPT
            mover.win[slots[pos // PS]][pos % PS] = prefix
        assert_window(table, mover, seq_id, tokens, end)  # what the step's queries read
        table.commit(seq_id, tokens[start:end])
        table.validate()


def assert_window(
    table: PageTable, mover: WindowFakeMover, seq_id: int, tokens: Sequence[int], end: int
) -> None:
    """Every position a query at `table.num_tokens(seq_id)` or later reads, up to `end`,
    has its window part in its page's slot."""
    slots = table.window_pages(seq_id, end)
    first = max(0, table.num_tokens(seq_id) - WINDOW + 1)
    for pos in range(first, end):
        got = mover.win[slots[pos // PS]][pos % PS]
        assert got == tuple(tokens[: pos + 1]), f"window position {pos}: {got}"


def turn(table, mover, seq_id: int, tokens: Sequence[int]):
    res = table.reserve(seq_id, tokens, count_as="prompt")
    assert res is not None
    assert_data(table, mover, seq_id, tokens)
    compute(table, mover, seq_id, tokens)
    assert_data(table, mover, seq_id, tokens)
    table.release(seq_id)
    table.validate()
    return res


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 97 + 1 for i in range(n)]


def test_a_live_sequence_holds_only_its_last_pages_window_parts():
    table, mover, window = make(num_pages=32, slots=12)
    history = tokens_of(1, 30)
    assert table.reserve(1, history, count_as="prompt") is not None
    compute(table, mover, 1, history)
    # the next query (position 30) reads 25..30: pages 6 and 7 only
    held = [p for p in table.pages(1) if window.has(p)]
    assert window.in_use - window.idle == 2 and len(held) <= window.num_slots - 1
    table.release(1)
    table.validate()
    assert window.idle == window.in_use  # kept as cache, none referenced


def test_a_conversation_resumed_at_its_end_computes_only_what_is_new():
    table, mover, _ = make(num_pages=32, slots=12)
    a = tokens_of(1, 30)
    turn(table, mover, 1, a)
    again = turn(table, mover, 2, [*a, 5, 6, 7])
    assert again.cached.device == 30


def test_a_match_whose_window_was_let_go_ends_where_the_window_is_whole():
    table, mover, window = make(num_pages=32, slots=12)
    a = tokens_of(1, 30)
    turn(table, mover, 1, a)
    for seed in (2, 3, 4):  # other conversations take every idle slot
        turn(table, mover, 10 + seed, tokens_of(seed, 30))
    assert window.let_go > 0
    fork = turn(table, mover, 20, [*a[:18], 50, 51])  # a's pages 0-3 are on the device
    assert fork.cached.device % PS == 0 and fork.cached.device < 18
    resumed = turn(table, mover, 21, [*a, 9])  # a's end: its window let go too
    assert resumed.cached.device < 30


def test_the_window_comes_back_from_the_host_tier_with_its_pages():
    table, mover, _ = make(num_pages=12, slots=12, host_slots=32)
    a, b = tokens_of(1, 30), tokens_of(2, 30)
    turn(table, mover, 1, a)
    turn(table, mover, 2, b)  # takes the device pages: a's go to the host tier
    assert table.residency(a).host > 0
    back = turn(table, mover, 3, [*a, 5, 6])
    assert back.cached.host > 0 and back.cached.total == 28  # its partial page was dropped


def test_admission_waits_while_live_windows_fill_the_slots():
    table, _, window = make(num_pages=32, slots=12)
    assert window.admits(2) and not window.admits(3)
    assert table.reserve(1, tokens_of(1, 10), count_as="prompt") is not None
    assert table.reserve(2, tokens_of(2, 10), count_as="prompt") is not None
    assert table.reserve(3, tokens_of(3, 10), count_as="prompt") is None
    table.release(1)
    assert table.reserve(3, tokens_of(3, 10), count_as="prompt") is not None
    table.validate()


def test_defragmentation_moves_a_page_with_its_window_slot():
    table, mover, _ = make(num_pages=32, slots=12)
    for seed in range(1, 4):
        turn(table, mover, seed, tokens_of(seed, 22))
    table.defragment(resuming=True)
    table.validate()
    again = turn(table, mover, 9, [*tokens_of(3, 22), 4])
    assert again.cached.device == 22


def test_residency_counts_what_a_switch_would_compute_again_as_nowhere():
    table, mover, window = make(num_pages=32, slots=12)
    a = tokens_of(1, 30)
    turn(table, mover, 1, a)
    assert table.residency([*a, 1]).device == 30
    for seed in (2, 3, 4):
        turn(table, mover, 10 + seed, tokens_of(seed, 30))
    assert window.let_go > 0
    r = table.residency([*a, 1])
    assert r.device < 30 and r.nowhere == 31 - r.device


# ---- a lower tier's copy without its window part is replaced by one with it -------------
#
# When a tier's copy left the device without its window part (it had been let go), a later
# device copy of the same page with the part (computed again after the match was cut) must
# reach the tier, or every switch back would cut the match again and compute the window
# (here the whole conversation) again.


def _evict_everything(table: PageTable, seq_id: int, seed: int) -> None:
    """A prompt that needs every device page (92 tokens: 24 pages) comes and goes."""
    assert table.reserve(seq_id, tokens_of(seed, 92), count_as="prompt") is not None
    table.release(seq_id)
    table.validate()


def test_a_window_recomputed_after_a_cut_reaches_the_host_tier():
    table, mover, window = make(num_pages=24, slots=12, host_slots=64)
    a = tokens_of(1, 30)
    turn(table, mover, 1, a)
    for seed in (2, 3, 4):  # short conversations take a's idle window parts
        turn(table, mover, 10 + seed, tokens_of(seed, 12))
    _evict_everything(table, 20, 5)  # a's pages go to the host, most without their part
    first = turn(table, mover, 21, [*a, 5])
    assert first.cached.total == 0  # cut back: a is recomputed, its window with it
    let_go = window.let_go
    _evict_everything(table, 22, 6)  # a's pages go to the host again, now with their parts
    assert window.let_go == let_go and table.residency(a).host == 28
    again = turn(table, mover, 23, [*a, 6])
    assert again.cached.host == 28


def test_a_window_recomputed_after_a_cut_reaches_the_disk_tier():
    window = WindowSlots(12, WINDOW, PS, CHUNK, 24)
    mover = WindowDiskMover(24, 0, window)
    table = PageTable(24, PS, SALT, None, mover, FakeDisk(), window)
    a = tokens_of(1, 60)
    turn(table, mover, 1, a)  # its first pages' parts are let go as it is computed...
    fork = a[:20]  # ...and its release saves them to disk without
    first = turn(table, mover, 2, [*fork, 50])
    assert first.cached.total == 0  # cut back: the fork's pages are recomputed, with parts
    _evict_everything(table, 3, 5)  # they leave the device, each with its part
    assert table.residency(fork).disk == 20
    again = turn(table, mover, 4, [*fork, 51])
    assert again.cached.disk == 20
