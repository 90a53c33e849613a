"""Session numbers: a session's place in the list (alt+N), for as long as it lives.

A number is given when a session is created: the lowest that no listed session holds.
It is stored with the session and kept while the session is archived, deleted (until
the undo lapses) and across restarts, so archiving or deleting one session never moves
another: alt+3 opens the same conversation before and after. A session that comes back
to the list (unarchived, undeleted) keeps its number unless another took it meanwhile,
then it takes the lowest free one. Sessions stored before numbers existed get theirs
in creation order, which is the order they were shown in.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvchat.chat.session import Session


def listed(session: Session) -> bool:
    """Whether the session list shows it (and so holds its number)."""
    return session.deleted_at is None and not session.archived


def lowest_free(taken: Iterable[int]) -> int:
    used = set(taken)
    number = 1
    while number in used:
        number += 1
    return number


def number_new(session: Session, others: Iterable[Session]) -> None:
    """Give a session joining the list (created, forked, back from the archive or the
    bin) its number: its own when still free, else the lowest free one."""
    taken = {s.number for s in others if s.id != session.id and listed(s)}
    if session.number <= 0 or session.number in taken:
        session.number = lowest_free(taken)


def number_loaded(sessions: Iterable[Session]) -> list[Session]:
    """Settle the numbers of the sessions read at start, oldest first: a listed session
    without one (stored before numbers) or sharing one with an older listed session
    (two kvchat processes created sessions at once) gets the lowest free number.
    Returns the sessions whose number changed, to be stored."""
    changed = []
    taken: set[int] = set()
    ordered = sorted(sessions, key=lambda s: (s.created, s.id))
    for session in ordered:  # first the numbers already given stand
        if listed(session) and session.number > 0 and session.number not in taken:
            taken.add(session.number)
    seen: set[int] = set()
    for session in ordered:
        if not listed(session):
            continue
        if session.number > 0 and session.number not in seen:
            seen.add(session.number)
            continue
        session.number = lowest_free(taken)
        taken.add(session.number)
        seen.add(session.number)
        changed.append(session)
    return changed
