"""Session numbers: given once, kept for a session's life, settled at start."""

from __future__ import annotations

from kvchat.chat.session import Session
from kvchat.chat.session_numbers import lowest_free, number_loaded, number_new


def session(name: str, created: float, number: int = 0, **kw) -> Session:
    return Session(id=name, title=name, created=created, updated=created, number=number, **kw)


def test_the_lowest_free_number_fills_gaps_first():
    assert lowest_free([]) == 1
    assert lowest_free([1, 2, 4]) == 3
    assert lowest_free([2, 3]) == 1


def test_a_session_back_in_the_list_keeps_its_number_unless_another_took_it():
    a, b = session("a", 1, 1), session("b", 2, 2, archived=True)
    number_new(b, [a, b])
    assert b.number == 2  # free: kept
    c = session("c", 3, 2)
    b.number = 2
    number_new(b, [a, b, c])
    assert b.number == 3  # 2 was taken meanwhile: the lowest free


def test_numbers_of_stored_sessions_are_settled_oldest_first():
    old1, old2 = session("o1", 1), session("o2", 2)  # stored before numbers existed
    kept = session("k", 3, 1)  # already numbered: its number stands
    twin = session("t", 4, 1)  # two processes gave the same number: the younger moves
    archived = session("x", 5, archived=True)  # not listed: no number needed yet
    changed = number_loaded([twin, old2, kept, archived, old1])
    assert kept.number == 1
    assert (old1.number, old2.number, twin.number) == (2, 3, 4)
    assert archived.number == 0
    assert {s.id for s in changed} == {"o1", "o2", "t"}
