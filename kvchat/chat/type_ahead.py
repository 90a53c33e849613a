"""`TypeAhead`: the service's side of type-ahead, computing a message while it is typed.

The composer's text becomes the session's draft (`drafts.py` renders it as `say`
would): the engine computes it at its lowest priority, so the turn that sends it
finds those pages cached. A draft typed while the session replies waits for the
reply's end (`SessionDraft.pending`); a turn that starts ends the draft, its pages
staying cached. Subscribers hear `DraftChanged` as the engine computes it.
"""

from __future__ import annotations

import contextlib
import logging

from kvchat.chat.drafts import draft_prompt
from kvchat.chat.events import ChatEvent, DraftChanged
from kvchat.chat.live_sessions import LiveSessions
from kvchat.chat.service_worker import ServiceWorker
from kvchat.chat.session import Session
from kvchat.chat.session_runtime import SessionRuntime
from kvchat.engine.api import DraftProgress, common_prefix

log = logging.getLogger("kvchat.chat")


class TypeAhead:
    """Each session's draft: submitted, replaced, ended; its progress published."""

    def __init__(self, live: LiveSessions, worker: ServiceWorker) -> None:
        self._live = live
        self._worker = worker

    # ------------------------------------------------------------- commands

    def draft(self, session_id: str, text: str) -> None:
        """Compute the user's unsent message ahead, at the engine's lowest priority.

        Rendered exactly as `say(text)` would render it, up to the end of the text,
        so the turn that sends it finds these pages cached. Replaces the session's
        previous draft (whose pages stay cached); an empty text ends it. While the
        session replies, the text waits for the reply's end.
        """
        live = self._live
        with live.lock:
            session = live.get(session_id)
            rt = live.runtime[session_id]
            if not text.strip():
                events = self.end_locked(session_id)
            elif rt.busy:
                rt.draft.pending = text
                events = []
            else:
                events = self.submit_locked(session, rt, text)
        live.publish(events)

    def end(self, session_id: str) -> None:
        """Stop computing the session's draft (its computed pages stay cached)."""
        with self._live.lock:
            self._live.get(session_id)
            events = self.end_locked(session_id)
        self._live.publish(events)

    def progress(self, session_id: str) -> tuple[int, int]:
        """(tokens ready, tokens in the draft); (0, 0) without a draft."""
        with self._live.lock:
            d = self._live.runtime[self._live.get(session_id).id].draft
            return (d.ready, len(d.ids)) if d.draft_id is not None else (0, 0)

    # ------------------------------------------------------ the lock held

    def submit_locked(self, session: Session, rt: SessionRuntime, text: str) -> list[ChatEvent]:
        """Render `text` as the next turn would and hand it to the engine (lock held)."""
        backend = self._live.backend
        max_tokens = session.max_tokens or backend.default_max_tokens
        ids = draft_prompt(
            session,
            backend.renderer,
            text,
            context_length=backend.engine.context_length,
            max_tokens=max_tokens,
        )
        if ids is None:
            return self.end_locked(session.id)
        d = rt.draft
        if d.draft_id is not None and ids == d.ids:
            return []
        sid = session.id

        def on_progress(event: DraftProgress) -> None:  # engine thread: hand over only
            self._worker.put(lambda: self._on_progress(sid, event))

        try:
            draft_id = backend.engine.draft(ids, on_progress, replaces=d.draft_id)
        except Exception:  # a draft is only a guess: the turn computes what it needs
            log.exception("engine draft failed")
            return self.end_locked(sid)
        d.draft_id, d.ready = draft_id, min(d.ready, common_prefix(d.ids, ids))
        d.ids = ids
        return [DraftChanged(sid, d.ready, len(ids))]

    def submit_pending_locked(self, session_id: str) -> list[ChatEvent]:
        """The session's reply ended and nothing waits behind it: submit the draft typed
        meanwhile, if any (lock held)."""
        rt = self._live.runtime[session_id]
        pending = rt.draft.pending
        if pending is None or rt.busy:
            return []
        rt.draft.pending = None
        return self.submit_locked(self._live.sessions[session_id], rt, pending)

    def end_locked(self, session_id: str) -> list[ChatEvent]:
        """Cancel the session's draft, if any, without waiting (lock held)."""
        d = self._live.runtime[session_id].draft
        draft_id, had = d.draft_id, d.draft_id is not None or d.pending is not None
        d.clear()
        if draft_id is not None:
            with contextlib.suppress(Exception):
                self._live.backend.engine.cancel(draft_id)
        return [DraftChanged(session_id, 0, 0)] if had else []

    def _on_progress(self, session_id: str, event: DraftProgress) -> None:
        """Worker thread: how much of a draft is computed now."""
        with self._live.lock:
            rt = self._live.runtime.get(session_id)
            if rt is None or rt.draft.draft_id != event.draft_id:
                return  # a draft since replaced or ended
            rt.draft.ready = event.ready_tokens
            events: list[ChatEvent] = [
                DraftChanged(session_id, event.ready_tokens, event.total_tokens)
            ]
        self._live.publish(events)
