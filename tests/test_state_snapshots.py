"""The states a hybrid model's table keeps at page ends: least recently used let go first,
dropped with their page, moved with it."""

from __future__ import annotations

from kvchat.engine.cache.state_snapshots import StateSnapshots


def test_the_least_recently_used_state_goes_first():
    states = StateSnapshots(2, state_bytes=10)
    states.put(1, "a")
    states.put(2, "b")
    assert states.get(1) == "a"  # used: page 2's is now the oldest
    states.put(3, "c")
    assert not states.has(2) and states.has(1) and states.has(3)
    assert states.let_go == 1 and states.nbytes() == 20


def test_a_state_goes_with_its_page_and_follows_it():
    states = StateSnapshots(3, state_bytes=1)
    states.put(1, "a")
    states.put(2, "b")
    states.moved(1, 7)
    assert states.get(7) == "a" and not states.has(1)
    states.drop(7)
    assert len(states) == 1 and not states.has(7)
