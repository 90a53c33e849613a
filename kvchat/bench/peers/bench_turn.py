"""Following one bench turn through the session layer's events.

kvchat's embedded peer and its remote peer drive the same `SessionService`; only
how they wait for the next event differs (stepping the engine inline, or blocking
on a server), so what an event means for the turn is said once, here.
"""

from __future__ import annotations

import time

from kvchat.chat.events import ChatEvent, ReplyDelta, ReplyFinished, SessionFailed
from kvchat.chat.session import TurnStats
from kvchat.errors import KvchatError


def follow(event: ChatEvent, session_id: str, first: float | None) -> tuple[float | None, bool]:
    """The time of the turn's first delta so far, and whether the turn has finished."""
    if isinstance(event, ReplyDelta) and event.session_id == session_id and first is None:
        return time.perf_counter(), False
    if isinstance(event, SessionFailed) and event.session_id == session_id:
        raise KvchatError(f"kvchat could not start a bench turn: {event.message}")
    return first, isinstance(event, ReplyFinished) and event.session_id == session_id


def finished_stats(event: ReplyFinished, first: float | None) -> TurnStats:
    """The finished turn's figures; a turn that failed or streamed nothing is an error."""
    stats = event.stats
    if stats.error is not None or first is None:
        raise KvchatError(f"kvchat failed a bench turn: {stats.error or 'no token came'}")
    return stats
