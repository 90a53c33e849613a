"""`TypeAhead`: the service's side of type-ahead, computing a message while it is typed.

The composer's text becomes the session's type-ahead (`type_ahead_prompt.py` renders it
as `say` would): the engine computes it at its lowest priority, so the turn that sends
it finds those pages cached. Text typed while the session replies waits for the reply's
end (`SessionTypeAhead.pending`); a turn that starts ends the type-ahead, its pages
staying cached. Subscribers hear `TypeAheadChanged` as the engine computes it.
"""

from __future__ import annotations

import contextlib
import logging

from kvchat.chat.events import ChatEvent, TypeAheadChanged
from kvchat.chat.live_sessions import LiveSessions
from kvchat.chat.service_worker import ServiceWorker
from kvchat.chat.session import Session
from kvchat.chat.session_runtime import SessionRuntime
from kvchat.chat.type_ahead_prompt import type_ahead_prompt
from kvchat.engine.api import TypeAheadProgress, common_prefix

log = logging.getLogger("kvchat.chat")


class TypeAhead:
    """Each session's type-ahead: submitted, replaced, ended; its progress published."""

    def __init__(self, live: LiveSessions, worker: ServiceWorker) -> None:
        self._live = live
        self._worker = worker

    # ------------------------------------------------------------- commands

    def update(self, session_id: str, text: str) -> None:
        """Compute the user's unsent message ahead, at the engine's lowest priority.

        Rendered exactly as `say(text)` would render it, up to the end of the text,
        so the turn that sends it finds these pages cached. Replaces the session's
        previous type-ahead (whose pages stay cached); an empty text ends it. While the
        session replies, the text waits for the reply's end.
        """
        live = self._live
        with live.lock:
            session = live.get(session_id)
            rt = live.runtime[session_id]
            if not text.strip():
                events = self.end_locked(session_id)
            elif rt.busy:
                rt.type_ahead.pending = text
                events = []
            else:
                events = self.submit_locked(session, rt, text)
        live.publish(events)

    def end(self, session_id: str) -> None:
        """Stop computing the session's type-ahead (its computed pages stay cached)."""
        with self._live.lock:
            self._live.get(session_id)
            events = self.end_locked(session_id)
        self._live.publish(events)

    def progress(self, session_id: str) -> tuple[int, int]:
        """(tokens ready, tokens in the type-ahead); (0, 0) without a type-ahead."""
        with self._live.lock:
            d = self._live.runtime[self._live.get(session_id).id].type_ahead
            return (d.ready, len(d.ids)) if d.request_id is not None else (0, 0)

    # ------------------------------------------------------ the lock held

    def submit_locked(self, session: Session, rt: SessionRuntime, text: str) -> list[ChatEvent]:
        """Render `text` as the next turn would and hand it to the engine (lock held)."""
        backend = self._live.backend
        max_tokens = session.max_tokens or backend.default_max_tokens
        ids = type_ahead_prompt(
            session,
            backend.renderer,
            text,
            context_length=backend.engine.context_length,
            max_tokens=max_tokens,
        )
        if ids is None:
            return self.end_locked(session.id)
        d = rt.type_ahead
        if d.request_id is not None and ids == d.ids:
            return []
        sid = session.id

        def on_progress(event: TypeAheadProgress) -> None:  # engine thread: hand over only
            self._worker.put(lambda: self._on_progress(sid, event))

        try:
            request_id = backend.engine.type_ahead(ids, on_progress, replaces=d.request_id)
        except Exception:  # a type-ahead is only a guess: the turn computes what it needs
            log.exception("engine type-ahead failed")
            return self.end_locked(sid)
        d.request_id, d.ready = request_id, min(d.ready, common_prefix(d.ids, ids))
        d.ids = ids
        return [TypeAheadChanged(sid, d.ready, len(ids))]

    def submit_pending_locked(self, session_id: str) -> list[ChatEvent]:
        """The session's reply ended and nothing waits behind it: submit the type-ahead typed
        meanwhile, if any (lock held)."""
        rt = self._live.runtime[session_id]
        pending = rt.type_ahead.pending
        if pending is None or rt.busy:
            return []
        rt.type_ahead.pending = None
        return self.submit_locked(self._live.sessions[session_id], rt, pending)

    def end_locked(self, session_id: str) -> list[ChatEvent]:
        """Cancel the session's type-ahead, if any, without waiting (lock held)."""
        d = self._live.runtime[session_id].type_ahead
        request_id, had = d.request_id, d.request_id is not None or d.pending is not None
        d.clear()
        if request_id is not None:
            with contextlib.suppress(Exception):
                self._live.backend.engine.cancel(request_id)
        return [TypeAheadChanged(session_id, 0, 0)] if had else []

    def _on_progress(self, session_id: str, event: TypeAheadProgress) -> None:
        """Worker thread: how much of a type-ahead is computed now."""
        with self._live.lock:
            rt = self._live.runtime.get(session_id)
            if rt is None or rt.type_ahead.request_id != event.type_ahead_id:
                return  # a type-ahead since replaced or ended
            rt.type_ahead.ready = event.ready_tokens
            events: list[ChatEvent] = [
                TypeAheadChanged(session_id, event.ready_tokens, event.total_tokens)
            ]
        self._live.publish(events)
