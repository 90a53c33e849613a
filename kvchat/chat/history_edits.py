"""`HistoryEdits`: commands that change a session's history or settings, not a turn's stream.

Create, rename, archive, delete and undo, fork, edit-and-resend, the system prompt
and the sampling parameters. Each changes the session under the service's lock,
stores it (write-behind, `persistence.py`) and publishes what changed. An edit
cuts the stored ids where the edited message began, so everything before it stays
cached; edit-and-resend is then a turn like a say (`turns.py`), its cut made only
once the new message is sized and fits.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import Iterable
from dataclasses import replace

from kvchat.chat.events import (
    SessionArchived,
    SessionCreated,
    SessionDeleted,
    SessionRenamed,
)
from kvchat.chat.live_sessions import LiveSessions
from kvchat.chat.persistence import Persistence
from kvchat.chat.prompt_plan import cut_ids
from kvchat.chat.session import Message, Session, new_message
from kvchat.chat.session_numbers import number_new
from kvchat.chat.session_runtime import SessionRuntime
from kvchat.chat.turns import Turns
from kvchat.chat.type_ahead import TypeAhead
from kvchat.engine.api import SamplingParams
from kvchat.errors import KvchatError


class HistoryEdits:
    """The session-changing commands; safe from any thread."""

    def __init__(
        self,
        live: LiveSessions,
        persistence: Persistence,
        turns: Turns,
        type_ahead: TypeAhead,
    ) -> None:
        self._live = live
        self._persistence = persistence
        self._turns = turns
        self._type_ahead = type_ahead

    def create_session(
        self,
        title: str = "New chat",
        *,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> str:
        live = self._live
        now = time.time()
        session = Session(
            id=uuid.uuid4().hex,
            title=title,
            created=now,
            updated=now,
            model_fingerprint=live.backend.engine.model_fingerprint,
            sampling=sampling or live.backend.default_sampling,
            max_tokens=max_tokens,
        )
        if system:
            session.messages.append(new_message("system", system))
        with live.lock:
            number_new(session, live.sessions.values())
            live.sessions[session.id] = session
            live.runtime[session.id] = SessionRuntime()
            self._persistence.persist(session, session.messages)
        live.publish([SessionCreated(session.id)])
        return session.id

    def rename(self, session_id: str, title: str) -> None:
        live = self._live
        with live.lock:
            session = live.get(session_id)
            session.title = title
            self._touch_and_persist(session)
            event = SessionRenamed(session_id, title, live.snapshot(session_id))
        live.publish([event])

    def set_archived(self, session_id: str, archived: bool = True) -> None:
        live = self._live
        with live.lock:
            session = live.get(session_id)
            session.archived = archived
            if not archived:
                number_new(session, live.sessions.values())
            self._touch_and_persist(session)
        live.publish([SessionArchived(session_id, archived)])

    def delete(self, session_id: str) -> None:
        """Soft delete: hidden now, kept until `undo_delete` or the next start."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            rt = live.runtime[session_id]
            rt.queue.clear()
            request_id = rt.request_id
            session.deleted_at = time.time()
            self._persistence.persist(session)
            self._type_ahead.end_locked(session_id)
        if request_id is not None:
            live.backend.engine.cancel(request_id)
        live.publish([SessionDeleted(session_id, True)])

    def undo_delete(self, session_id: str) -> None:
        live = self._live
        with live.lock:
            session = live.get(session_id)
            session.deleted_at = None
            number_new(session, live.sessions.values())
            # every message again: another kvchat starting meanwhile purged the deleted rows
            self._persistence.persist(session, session.messages)
        live.publish([SessionDeleted(session_id, False)])

    def set_sampling(
        self, session_id: str, sampling: SamplingParams, max_tokens: int | None = None
    ) -> None:
        """The session's own sampling parameters (and max_tokens) for its next turns."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            session.sampling = sampling
            session.max_tokens = max_tokens
            self._touch_and_persist(session)
            event = live.changed(session_id)
        live.publish([event])

    def set_system_prompt(self, session_id: str, text: str | None) -> None:
        """Change (or remove, with None/"") the system prompt: the ids are cut at 0."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            live.require_idle(session_id, "change the system prompt")
            removed: list[str] = []
            if session.system_prompt is not None:
                if text:
                    session.messages[0].content = text
                else:
                    removed.append(session.messages[0].id)
                    del session.messages[0]
            elif text:
                session.messages.insert(0, new_message("system", text))
            session.ids, session.ids_stale = array("I"), True  # cut at 0: render it all
            for m in session.messages:
                m.offset = None
            self._touch_and_persist(session, session.messages, removed=removed)
            event = live.changed(session_id)
        live.publish([event])

    def edit_last_user_message(self, session_id: str, text: str) -> int:
        """Edit-and-resend: a turn that first cuts the ids where the last user message
        began, then says `text`. Returns the turn's number (`SessionFailed.turn`)."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            live.require_idle(session_id, "edit the last message")
            users = [i for i, m in enumerate(session.messages) if m.role == "user"]
            if not users:
                raise KvchatError("there is no message of yours to edit")
            number, events, _ = self._turns.submit_locked(session_id, text, cut_at=users[-1])
        live.publish(events)
        return number

    def fork(self, session_id: str, at_message: int, title: str | None = None) -> str:
        """A new session with the messages before `at_message` (a user message, or the end).

        It copies the ids up to that point, so its first turn shares the source's
        cached pages.
        """
        live = self._live
        with live.lock:
            source = live.get(session_id)
            n = len(source.messages)
            if not 0 <= at_message <= n:
                raise KvchatError(f"cannot fork at message {at_message}: it has {n} messages")
            if at_message < n and source.messages[at_message].role != "user":
                raise KvchatError("fork at one of your messages (or at the end)")
            if at_message == n:
                live.require_idle(session_id, "fork at the end")
            now = time.time()
            fork = Session(
                id=uuid.uuid4().hex,
                title=title or f"{source.title} (fork)",
                created=now,
                updated=now,
                model_fingerprint=source.model_fingerprint,
                model_name=source.model_name,
                sampling=source.sampling,
                max_tokens=source.max_tokens,
                messages=[replace(m, id=uuid.uuid4().hex) for m in source.messages[:at_message]],
                ids=array("I", source.ids),
                ids_stale=source.ids_stale,
            )
            if at_message < n:
                cut_ids(fork, at_message, source.messages[at_message])
            number_new(fork, live.sessions.values())
            live.sessions[fork.id] = fork
            live.runtime[fork.id] = SessionRuntime(last_stats=live.runtime[session_id].last_stats)
            self._persistence.persist(fork, fork.messages)
        live.publish([SessionCreated(fork.id)])
        return fork.id

    def keep_unsent(self, session_id: str, text: str) -> None:
        """Store what the user typed for the session and has not sent (its composer's
        text), so that it is there after a switch, a restart or a crash."""
        with self._live.lock:
            session = self._live.get(session_id)
            if session.unsent == text:
                return
            session.unsent = text
            self._persistence.persist(session)  # `updated` unchanged: typing does not reorder

    def _touch_and_persist(
        self, session: Session, messages: Iterable[Message] = (), *, removed: Iterable[str] = ()
    ) -> None:
        session.updated = time.time()
        self._persistence.persist(session, messages, removed=removed)
