"""Behaviour of the page table: sharing, prompt cache, tail reuse, host tier, eviction order.

A fake mover stands in for the K/V tensors: each slot holds the whole token prefix
that produced it, so a test can check that data followed the table through every
copy, restore and move (a slot in the wrong page shows up as the wrong prefix).
"""

from __future__ import annotations

import pytest

from kvchat.engine.cache.page_hash import page_hash, root_salt
from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.stats import Residency
from kvchat.engine.tiers.host_tier import HostTier
from tests.page_table_helpers import PS, SALT, FakeMover, assert_data, compute, make, run_turn


def counters_add_up(table: PageTable) -> None:
    s = table.stats()
    assert s.counters.prompt_tokens == s.counters.cached_tokens.total + s.counters.prefilled_tokens


def test_two_requests_sharing_a_prefix_hold_its_pages_once() -> None:
    table, mover = make(16)
    prefix = list(range(100, 112))  # 3 full pages
    a = [*prefix, 1, 2]
    b = [*prefix, 7, 8, 9]
    table.reserve(1, a, count_as="prompt")
    compute(table, mover, 1, a)
    res = table.reserve(2, b, count_as="prompt")
    assert res is not None
    assert res.cached.device == 12 and res.to_compute_from == 12
    assert table.pages(1)[:3] == table.pages(2)[:3]
    assert [table.page_info(p).refcount for p in table.pages(2)[:3]] == [2, 2, 2]
    assert set(table.pages(1)[3:]).isdisjoint(table.pages(2)[3:])
    compute(table, mover, 2, b)
    assert_data(table, mover, 1, a)
    assert_data(table, mover, 2, b)
    table.validate()


def test_switching_back_reuses_the_partial_tail_of_the_previous_turn() -> None:
    table, mover = make(16)
    turn1 = list(range(10))  # 2 full pages + 2 tokens in a partial page
    run_turn(table, mover, 1, turn1)
    other = [50, 51, 52, 53, 54]
    run_turn(table, mover, 2, other)  # another conversation in between
    turn2 = [*turn1, 20, 21, 22]
    res = run_turn(table, mover, 3, turn2)
    assert res.cached.device == len(turn1)  # everything of the previous turn, tail included
    assert res.reused_tail == 2
    assert res.to_compute_from == len(turn1)
    s = table.stats()
    assert s.counters.prefilled_tokens == len(turn1) + len(other) + 3
    counters_add_up(table)


def test_at_least_the_last_token_is_always_computed() -> None:
    table, mover = make(16)
    tokens = list(range(8))  # exactly two full pages
    run_turn(table, mover, 1, tokens)
    res = run_turn(table, mover, 2, tokens)
    assert res.to_compute_from == 7  # the second page is reused as a 3-token tail copy
    assert res.reused_tail == 3
    assert len(res.pages) == 3  # 8 tokens + 1 generated slot


def test_page_aligned_prompt_on_host_restores_its_last_page_as_a_tail() -> None:
    table, mover = make(3, host_slots=8)
    tokens = list(range(8))
    run_turn(table, mover, 1, tokens)
    run_turn(table, mover, 2, [90, 91, 92, 93, 94, 95, 96, 97])  # pushes the first to host
    assert table.residency(tokens).host == 8
    res = run_turn(table, mover, 3, tokens)
    assert (res.cached.host, res.cached.device, res.to_compute_from) == (7, 0, 7)


def test_evicted_pages_come_back_from_host_and_the_longest_prefix_survives() -> None:
    table, mover = make(6, host_slots=16)
    a = list(range(100, 120))  # 5 full pages
    run_turn(table, mover, 1, a)
    b = list(range(200, 208))  # 2 full pages + 1 slot: needs 3 pages, evicts 2 of a's
    run_turn(table, mover, 2, b)
    # tail first: a's deepest pages went to the host, its first three stayed on the device
    assert table.residency(a).device == 12 and table.residency(a).host == 8
    s = table.stats()
    assert s.counters.evictions.device_to_host == 2 and s.counters.evictions.device_dropped == 0
    res = run_turn(table, mover, 3, [*a, 1])
    assert (res.cached.device, res.cached.host) == (12, 8)
    assert mover.count("h2d") == 2
    counters_add_up(table)
    s = table.stats()
    assert s.counters.prompt_tokens == 20 + 8 + 21
    assert s.counters.cached_tokens.host == 8 and s.counters.cached_tokens.device == 12


def test_without_host_tier_evicted_pages_are_dropped_tail_first() -> None:
    table, mover = make(6)
    a = list(range(100, 120))
    run_turn(table, mover, 1, a)
    run_turn(table, mover, 2, list(range(200, 208)))
    assert table.residency(a) == Residency(device=12, host=0, nowhere=8)
    assert table.stats().counters.evictions.device_dropped == 2
    res = run_turn(table, mover, 3, [*a, 1])
    assert res.cached.device == 12 and res.cached.host == 0


def test_orphans_are_evicted_before_an_older_intact_tree() -> None:
    table, mover = make(6)
    other_salt = root_salt("another-model", "float32", "fp")
    old = list(range(100, 108))
    run_turn(table, mover, 1, old)  # an intact tree, used first
    table.salt = other_salt  # another model's turn on the same pool
    stale = list(range(200, 208))
    run_turn(table, mover, 2, stale)  # used last, but keyed by a salt about to be left
    table.salt = SALT
    table.validate()
    # stale's pages chain to a salt in neither tier: they can never match again
    assert table.residency(stale).device == 0
    run_turn(table, mover, 3, list(range(300, 312)))  # needs 4 pages: 2 free + 2 victims
    assert table.residency(old).device == 8  # the older intact tree is untouched
    assert table.stats().counters.evictions.device_dropped == 2


def test_trees_are_evicted_least_recently_used_root_first_tail_first() -> None:
    table, mover = make(7)
    a = list(range(100, 108))  # 2 full pages (+1 empty page, freed on release)
    b = list(range(200, 208))
    c = list(range(300, 308))
    for i, t in enumerate((a, b, c)):
        run_turn(table, mover, i, t)
    run_turn(table, mover, 10, [*a, 1])  # a is used again: b is now the oldest tree
    assert table.stats().pages.device.free == 0
    run_turn(table, mover, 11, list(range(400, 408)))  # needs 3 victims
    assert table.residency(b).device == 0  # the LRU tree goes whole ...
    assert table.residency(c).device == 4  # ... then the next one loses its tail only
    assert table.residency([*a, 1]).device == 9  # the most recent tree is intact


def test_host_tier_drops_orphans_first_then_lru_trees_leaf_first() -> None:
    salt = b"s" * 16
    host = HostTier(3)
    r = page_hash(salt, [1, 2, 3, 4])
    c = page_hash(r, [5, 6, 7, 8])
    o = page_hash(b"gone" * 4, [9, 9, 9, 9])

    def anchored(h: bytes) -> bool:
        return h == salt

    host.put(r, salt, (1, 2, 3, 4), 1, anchored=anchored)
    host.put(c, r, (5, 6, 7, 8), 2, anchored=anchored)
    host.put(o, b"gone" * 4, (9, 9, 9, 9), 3, anchored=anchored)  # newest, but an orphan
    n1 = page_hash(salt, [4, 4, 4, 4])
    host.put(n1, salt, (4, 4, 4, 4), 4, anchored=anchored)
    assert o not in host and r in host and c in host
    n2 = page_hash(salt, [5, 5, 5, 5])
    host.put(n2, salt, (5, 5, 5, 5), 5, anchored=anchored)
    assert c not in host and r in host  # the oldest tree loses its leaf first
    assert host.dropped == 2
    assert host.problems(4) == []
    # a protected page is never dropped, and with everything protected nothing is
    assert (
        host.put(
            page_hash(salt, [6] * 4), salt, (6,) * 4, 6, anchored=anchored, protect={r, n1, n2}
        )
        is None
    )


def test_residency_changes_nothing() -> None:
    table, mover = make(6, host_slots=4)
    a = list(range(100, 120))
    run_turn(table, mover, 1, a)
    run_turn(table, mover, 2, list(range(200, 208)))
    assert table.host is not None

    def snapshot() -> object:
        pages = [table.page_info(p) for p in range(6)]
        host = sorted((h.hash, h.slot, h.last_used) for h in table.host.pages())
        return table.stats(), pages, host, len(mover.calls), table._clock  # clock: white-box

    before = snapshot()
    assert table.residency([*a, 5, 6]) == Residency(device=12, host=8, nowhere=2)
    assert table.residency(list(range(200, 203))) == Residency(device=3, host=0, nowhere=0)
    assert snapshot() == before


def test_residency_counts_a_matching_partial_tail_as_device() -> None:
    table, mover = make(8)
    run_turn(table, mover, 1, list(range(10)))
    r = table.residency([*range(10), 99])
    assert (r.device, r.host, r.nowhere) == (10, 0, 1)


def test_prefetch_restores_host_pages_so_the_next_turn_hits_the_device() -> None:
    table, mover = make(6, host_slots=8)
    a = list(range(100, 120))
    run_turn(table, mover, 1, a)
    run_turn(table, mover, 2, list(range(200, 208)))
    assert table.residency(a).host == 8
    restored = table.prefetch(a)
    table.validate()
    assert restored == 2
    assert table.residency(a).device == 20
    res = run_turn(table, mover, 3, [*a, 1])
    assert res.cached.device == 20 and res.cached.host == 0


def test_reserve_that_cannot_fit_returns_none_and_changes_nothing() -> None:
    table, mover = make(4, host_slots=2)
    run_turn(table, mover, 1, list(range(100, 108)))
    live = list(range(300, 303))
    table.reserve(2, live, count_as="prompt")
    compute(table, mover, 2, live)
    before = (table.stats(), [table.page_info(p) for p in range(4)], table._clock)
    calls = len(mover.calls)
    # needs 4 pages; 3 could be had (1 free + 2 cached), so eviction is weighed, then refused
    assert table.reserve(3, list(range(500, 512)), count_as="prompt") is None
    assert (table.stats(), [table.page_info(p) for p in range(4)], table._clock) == before
    assert len(mover.calls) == calls
    assert not table.is_live(3)
    table.validate()


def test_ensure_capacity_fails_without_change_when_the_pool_is_exhausted() -> None:
    table, _ = make(2)
    table.reserve(1, [1, 2, 3], count_as="prompt")
    table.reserve(2, [4, 5, 6], count_as="prompt")
    assert not table.ensure_capacity(1, 9)
    assert len(table.pages(1)) == 1
    table.validate()


def test_different_salts_never_match() -> None:
    mover = FakeMover(8, 0)
    table = PageTable(8, PS, SALT, None, mover)
    tokens = list(range(9))
    run_turn(table, mover, 1, tokens)
    assert table.residency(tokens).device == 9
    other = root_salt("test-model", "bfloat16", "fp")  # same model, other dtype
    assert other != SALT
    assert page_hash(other, tokens[:4]) != page_hash(SALT, tokens[:4])
    # the same pool rekeyed for another dtype holds the pages but never matches them
    table.salt = other
    assert table.residency(tokens).device == 0
    res = run_turn(table, mover, 2, tokens)
    assert res.cached_tokens == 0


def test_concurrent_identical_prefixes_keep_one_indexed_copy() -> None:
    table, mover = make(8)
    t = list(range(100, 106))
    table.reserve(1, t, count_as="prompt")
    table.reserve(2, t, count_as="prompt")  # nothing indexed yet: both compute
    compute(table, mover, 1, t)
    compute(table, mover, 2, t)
    table.validate()
    first = [table.page_info(table.pages(s)[0]) for s in (1, 2)]
    assert sorted(i.indexed for i in first) == [False, True]
    table.release(1)
    table.release(2)
    table.validate()
    assert (
        table.stats().pages.device.cached == 2
    )  # one full page + one partial tail; the copy freed


def test_recompute_counts_apart_from_prompt_tokens() -> None:
    table, mover = make(8)
    t = list(range(100, 110))
    table.reserve(1, t, count_as="prompt")
    compute(table, mover, 1, [*t, 7, 8])
    table.release(1)  # preempted after two generated tokens
    res = table.reserve(1, [*t, 7, 8], count_as="recompute")
    assert res is not None and res.to_compute_from == 11
    s = table.stats()
    assert s.counters.prompt_tokens == 10 and s.counters.prefilled_tokens == 10
    assert s.counters.recomputed_tokens == 1
    counters_add_up(table)


CONVERSATION_A, CONVERSATION_B = list(range(100, 116)), list(range(200, 208))


def two_interleaved_conversations():
    """A 12-page table where two finished conversations' pages alternate."""
    table, mover = make(12)
    a, b = CONVERSATION_A, CONVERSATION_B
    table.reserve(1, a[:1], count_as="prompt")
    table.reserve(2, b[:1], count_as="prompt")
    for n in range(1, 17):
        for sid, toks in ((1, a), (2, b)):
            if n <= len(toks):
                compute(table, mover, sid, toks[:n])
    table.release(1)
    table.release(2)
    return table, mover


def test_defragment_lays_chains_out_contiguously_from_page_zero() -> None:
    table, mover = two_interleaved_conversations()
    a = CONVERSATION_A
    table.validate()
    moved = table.defragment()
    table.validate()
    assert moved > 0
    # the longer tree first, then two free pages of room to grow, then the next tree
    firsts = [table.page_info(p).tokens[:1] for p in range(8)]
    assert firsts == [(100,), (104,), (108,), (112,), (), (), (200,), (204,)]
    for p in (0, 1, 2, 3, 6, 7):
        info = table.page_info(p)
        assert tuple(s[-1] for s in mover.dev[p]) == info.tokens  # data moved with the page
    assert table.defragment() == 0  # already packed
    res = run_turn(table, mover, 3, [*a, 9])
    assert res.pages == (0, 1, 2, 3, 4)  # the next turn grows into the room left after it


def test_defragment_in_slices_reaches_the_layout_of_one_pass() -> None:
    """The engine defragments a few pages per idle step: slices of two moves each end
    where a single pass ends, and then report nothing left to do."""
    whole, _ = two_interleaved_conversations()
    assert whole.defragment() > 0
    sliced, mover = two_interleaved_conversations()
    calls = 0
    while sliced.defragment(max_moves=2, resuming=calls > 0):  # a park takes two moves
        sliced.validate()
        calls += 1
        assert calls < 50, "slices never settle"
    assert calls > 1
    for p in range(12):
        assert sliced.page_info(p).tokens == whole.page_info(p).tokens
        if sliced.page_info(p).tokens:
            assert tuple(s[-1] for s in mover.dev[p]) == sliced.page_info(p).tokens


def test_defragment_leaves_no_gaps_when_the_pool_is_nearly_full() -> None:
    table, mover = make(7)  # one spare page: room to move, not to leave a gap per tree
    a, b = list(range(100, 112)), list(range(200, 212))
    table.reserve(1, a[:1], count_as="prompt")
    table.reserve(2, b[:1], count_as="prompt")
    for n in range(1, 13):
        compute(table, mover, 1, a[:n])
        compute(table, mover, 2, b[:n])
    table.release(1)
    table.release(2)
    assert table.defragment() > 0
    table.validate()
    firsts = [table.page_info(p).tokens[:1] for p in range(6)]
    runs = [[(100,), (104,), (108,)], [(200,), (204,), (208,)]]
    assert firsts in (runs[0] + runs[1], runs[1] + runs[0])  # two runs, no gap (equal height)


def test_a_new_turn_extends_the_cached_partial_page_in_place() -> None:
    """The previous turn's partial page is the new turn's tail page (no copy), and the
    new pages follow it, so the whole context stays one ascending run of pages."""
    table, mover = make(16)
    turn1 = list(range(10))  # two full pages and one holding 2 tokens
    first = run_turn(table, mover, 1, turn1)
    assert first.pages == (6, 7, 8)  # mid-way into the free pool: room to grow after it
    other = run_turn(table, mover, 2, [50, 51, 52, 53, 54])  # another conversation
    assert other.pages == (11, 12)  # mid-way into the largest free run left, 9-15
    turn2 = [*turn1, *range(20, 27)]  # 17 tokens + 1 generated: 5 pages
    before = mover.count("copy")
    res = run_turn(table, mover, 3, turn2)
    assert mover.count("copy") == before  # extended in place, not copied
    assert res.reused_tail == 2 and res.to_compute_from == len(turn1)
    assert res.pages == (6, 7, 8, 9, 10)  # one run: it grew into the room left after it
    counters_add_up(table)


def test_a_partial_page_with_more_tokens_than_matched_is_copied_not_extended() -> None:
    table, mover = make(16)
    run_turn(table, mover, 1, [*range(8), 30, 31, 32])  # page 2 holds 30, 31, 32
    before = mover.count("copy")
    res = run_turn(table, mover, 2, [*range(8), 30, 40])  # shares only 30 of that page
    assert mover.count("copy") == before + 1
    assert res.reused_tail == 1
    # the other branch's tail is still cached and still matches in full
    assert table.residency([*range(8), 30, 31, 32, 33]).device == 11


def test_defragment_does_nothing_while_a_sequence_is_live() -> None:
    table, _ = make(8)
    table.reserve(1, [1, 2, 3], count_as="prompt")
    assert table.defragment() == 0


@pytest.mark.parametrize(("num_pages", "expect_moves"), [(12, True), (40, False)])
def test_defragment_skips_when_under_a_tenth_of_pages_would_move(
    num_pages: int, expect_moves: bool
) -> None:
    table, mover = make(num_pages)
    for sid in range(5):  # occupy pages 0-4 without writing anything
        table.reserve(sid, [sid], count_as="prompt")
    run_turn(table, mover, 9, list(range(100, 108)))  # cached at pages 5 and 6
    for sid in range(5):
        table.release(sid)
    table.validate()
    moved = table.defragment()
    assert (moved > 0) == expect_moves  # 2 misplaced pages: 17% of 12, 5% of 40
    table.validate()
    if expect_moves:
        assert table.residency(list(range(100, 108))).device == 8
        assert table.page_info(0).tokens == (100, 101, 102, 103)


def test_defragment_respects_max_moves() -> None:
    table, mover = make(12)
    for sid in range(5):
        table.reserve(sid, [sid], count_as="prompt")
    run_turn(table, mover, 9, list(range(100, 108)))
    for sid in range(5):
        table.release(sid)
    assert table.defragment(max_moves=1) == 1
    table.validate()
    assert table.page_info(0).tokens == (100, 101, 102, 103)
    assert tuple(s[-1] for s in mover.dev[0]) == (100, 101, 102, 103)


def test_a_live_duplicate_stays_matchable_after_the_indexed_copy_is_evicted() -> None:
    table, mover = make(7)
    t = list(range(100, 105))
    for sid in (1, 2):  # computed concurrently: page of 1 is indexed, page of 2 a duplicate
        table.reserve(sid, t, count_as="prompt")
    compute(table, mover, 1, t)
    compute(table, mover, 2, t)
    table.release(1)
    table.reserve(3, list(range(200, 216)), count_as="prompt")  # evicts 1's pages entirely
    table.validate()
    table.release(3)
    res = table.reserve(4, [*t[:4], 7], count_as="prompt")
    assert res is not None and res.cached.device == 4
    assert res.pages[0] == table.pages(2)[0]  # shares sequence 2's copy
    assert table.page_info(res.pages[0]).refcount == 2
    assert_data(table, mover, 4, [*t[:4], 7])
    table.validate()
