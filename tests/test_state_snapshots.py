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


def test_where_a_sequence_ended_is_let_go_after_what_sequences_passed_by():
    states = StateSnapshots(3, state_bytes=1)
    states.put(1, "end of a")
    states.mark_resume(1)
    for page in range(10, 20):  # a long prompt's page ends
        states.put(page, f"passed {page}")
    assert states.has(1) and states.has(19) and len(states) == 3
    states.mark_resume(18)
    states.mark_resume(19)  # every state kept is now a resume point
    states.put(30, "x")  # the state just kept stays; the oldest resume point goes
    assert not states.has(1) and states.has(30) and states.let_go == 9
