"""`LiveSessions`: what every part of the session service shares, under one lock.

The sessions and their live state (`session_runtime.py`), the backend they run on
(replaced whole on a model switch), the subscribers, and the snapshots the events
carry. The service's parts (`turns.py`, `history_edits.py`, `type_ahead.py`,
`persistence.py`) each change the sessions under this one lock, so the order in
which they do is one order; subscribers are always called outside it.

Why events carry snapshots: a subscriber on another thread (the TUI) shows what an
event announces without calling back into the service. Every view is numbered
(`SessionView.taken`) as it is taken under the lock, so of two views of a session
the larger number is the newer, whichever thread published it first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvchat.chat.engine_port import RendererPort, TurnPort
from kvchat.chat.events import ChatEvent, SessionChanged
from kvchat.chat.session import MessageView, Session, SessionSnapshot, SessionView
from kvchat.chat.session_runtime import SessionRuntime
from kvchat.engine.api import SamplingParams
from kvchat.errors import KvchatError

log = logging.getLogger("kvchat.chat")

Subscriber = Callable[[ChatEvent], None]


@dataclass(frozen=True)
class SessionBackend:
    """The engine the sessions run on and what goes with its model."""

    engine: TurnPort
    renderer: RendererPort
    stop_ids: frozenset[int]
    default_sampling: SamplingParams
    default_max_tokens: int
    model_name: str = ""  # as it was asked for (--model); "": not known


class LiveSessions:
    """The sessions, their runtimes and the backend, under `lock`; publishes events."""

    def __init__(self, backend: SessionBackend) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)  # notified when a turn starts or ends
        self.sessions: dict[str, Session] = {}
        self.runtime: dict[str, SessionRuntime] = {}
        self.focused: str | None = None
        # per session, announcements not published yet: a finished reply being stored,
        # a turn's start (`wait_idle` waits for them)
        self.announcing: Counter[str] = Counter()
        self._subscribers: list[Subscriber] = []
        self._taken = 0  # views numbered so far

    # ---------------------------------------------------------------- events

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        with self.lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self.lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def publish(self, events: Iterable[ChatEvent]) -> None:
        """Call every subscriber with each event (never under the lock)."""
        with self.lock:
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    log.exception("a session event subscriber failed")

    def announcement_begins(self, session_id: str) -> None:
        """Events of the session will be published soon (lock held)."""
        self.announcing[session_id] += 1

    def announcement_ends(self, session_id: str) -> None:
        """Those events were published: wake `wait_idle` (takes the lock)."""
        with self.idle:
            self.announcing[session_id] -= 1
            if self.announcing[session_id] <= 0:
                del self.announcing[session_id]
            self.idle.notify_all()

    # ------------------------------------------------------- reading (lock held)

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise KvchatError(f"no session {session_id!r}") from None

    def require_idle(self, session_id: str, what: str) -> None:
        if self.runtime[session_id].busy:
            raise KvchatError(f"cannot {what} while the session is replying; stop it first")

    def view(self, s: Session) -> SessionView:
        rt = self.runtime[s.id]
        backend = self.backend
        self._taken += 1
        return SessionView(
            id=s.id,
            title=s.title,
            state=rt.state,
            archived=s.archived,
            unread=rt.unread,
            queued_says=rt.queued_turns,
            message_count=len(s.messages),
            context_tokens=None if s.ids_stale else len(s.ids) + len(rt.generated),
            context_length=backend.engine.context_length,
            last_turn=rt.last_stats,
            system_prompt=s.system_prompt,
            sampling=s.sampling,
            max_tokens=s.max_tokens or backend.default_max_tokens,
            model_fingerprint=s.model_fingerprint,
            notice=rt.notice,
            created=s.created,
            updated=s.updated,
            number=s.number,
            unsent=s.unsent,
            model_name=s.model_name,
            taken=self._taken,
        )

    def messages(self, session_id: str) -> tuple[MessageView, ...]:
        session = self.get(session_id)
        return tuple(
            MessageView(m.id, i, m.role, m.content, m.state, m.in_context, m.stats)
            for i, m in enumerate(session.messages)
        )

    def snapshot(self, session_id: str) -> SessionSnapshot:
        """The session's view and messages as they are now (lock held)."""
        return SessionSnapshot(self.view(self.get(session_id)), self.messages(session_id))

    def changed(self, session_id: str) -> SessionChanged:
        """`SessionChanged` with the session as it is now (lock held)."""
        return SessionChanged(session_id, self.snapshot(session_id))
