"""The page table of a hybrid model (`StateSnapshots`): the state a request resumes from
survives the evictions its own admission makes, and a state computed again on a page
that duplicates an indexed one reaches the indexed page."""

from __future__ import annotations

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.cache.state_snapshots import StateSnapshots
from kvchat.engine.tiers.host_tier import HostTier
from tests.page_table_helpers import PS, SALT, FakeMover, compute


def hybrid(num_pages: int, host_slots: int, capacity: int):
    mover = FakeMover(num_pages, host_slots)
    states = StateSnapshots(capacity, state_bytes=1)
    table = PageTable(num_pages, PS, SALT, HostTier(host_slots), mover, states=states)
    return table, mover


def turn(table, mover, seq_id, tokens):
    """Admit, compute, keep the state at each page end crossed (as the engine), release."""
    res = table.reserve(seq_id, tokens, count_as="prompt")
    assert res is not None
    start = res.cached.total
    compute(table, mover, seq_id, tokens)
    pages = table.pages(seq_id)
    for end in range((start // PS + 1) * PS, len(tokens) + 1, PS):
        table.keep_state(pages[end // PS - 1], ("state", tuple(tokens[:end])))
    table.release(seq_id)
    return res


def test_resume_page_host_state_survives_the_evictions_its_own_reserve_makes():
    # one state kept at most (device and host alike); two device pages
    table, mover = hybrid(num_pages=2, host_slots=4, capacity=1)
    a = [1, 2, 3, 4, 5]
    turn(table, mover, 1, a)  # state at a's page 0 end
    turn(table, mover, 2, [9, 8, 7, 6, 5])  # evicts a's page 0 to host (with its state)
    # a's follow-up resumes at its host page: the plan sees its host state, but making
    # room evicts b's page 0 with its state, which pushes a's host state out first
    res = table.reserve(3, [*a, 6], count_as="prompt")
    assert res is not None
    assert table.resume_state(3) == ("state", (1, 2, 3, 4))


def test_the_host_tier_keeps_states_in_host_memory_and_gives_them_back_on_the_device():
    """A state leaving the device with its page is kept in the host tier's form (on a GPU:
    host memory, not the device memory the tier frees), and a request resuming there gets
    it back in the device's form."""
    table, mover = hybrid(num_pages=2, host_slots=4, capacity=4)
    a = [1, 2, 3, 4, 5]
    turn(table, mover, 1, a)
    turn(table, mover, 2, [9, 8, 7, 6, 5])  # a's page 0 goes to the host with its state
    kept = list(table._tiers.host_states.values())
    assert ("on host", ("state", (1, 2, 3, 4))) in kept
    res = table.reserve(3, [*a, 6], count_as="prompt")
    assert res is not None and res.cached.total == PS
    assert table.resume_state(3) == ("state", (1, 2, 3, 4))


def test_a_state_recomputed_on_a_duplicate_page_reaches_the_indexed_page():
    """A page whose state was let go is computed again (the match is cut before it) into a
    fresh page, a duplicate of the indexed one: the state kept there goes when the
    duplicate is freed, so the next request is cut at the same place again (a type-ahead
    chunk ending within the old pages makes no progress at all)."""
    table, mover = hybrid(num_pages=16, host_slots=1, capacity=8)
    history = list(range(1, 14))  # 3 full pages and one token
    indexed = list(turn(table, mover, 1, history).pages[:3])  # states at 4, 8, 12
    assert all(table.states.has(p) for p in indexed)
    table.states.drop(indexed[1])  # let go (LRU) at 8 and 12
    table.states.drop(indexed[2])
    res = turn(table, mover, 2, history)
    assert res.cached.total == 4  # cut back to the page with a state
    # the states at 8 and 12 were computed again: the indexed pages should have them now
    res = table.reserve(3, history, count_as="prompt")
    assert res.cached.total == 12, res.cached


def test_a_prefetch_brings_a_host_state_back_in_the_devices_form():
    """A prefetch restores a host page ahead of its request: the state it brings to the
    device is the device's form, and the request resumes from it."""
    table, mover = hybrid(num_pages=3, host_slots=4, capacity=4)
    a = [1, 2, 3, 4, 5]
    turn(table, mover, 1, a)
    turn(table, mover, 2, [9, 8, 7, 6, 5, 4, 3, 2, 1])  # a's page 0 goes to the host
    assert ("on host", ("state", (1, 2, 3, 4))) in table._tiers.host_states.values()
    assert table.prefetch([*a, 6]) == 1
    assert ("state", (1, 2, 3, 4)) in kept(table)
    assert all(state[0] != "on host" for state in kept(table))
    res = table.reserve(3, [*a, 6], count_as="prompt")
    assert res is not None and res.cached.total == PS
    assert table.resume_state(3) == ("state", (1, 2, 3, 4))


def kept(table) -> list:
    """The states the device keeps now."""
    states = table.states
    return [states.get(p) for p in range(table.num_pages) if states.has(p)]
