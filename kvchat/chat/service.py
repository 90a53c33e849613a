"""`SessionService`: the sessions over one engine and one store, safe from any thread.

The one code path for conversations: the TUI, the headless mode and the benchmark
drive this class. It is the front of the session layer and wires its parts, each
a file of its own:

- `live_sessions.py`: the sessions, their live state, the backend, one lock, the
  subscribers, and the snapshots events carry;
- `turns.py`: a turn's one path (submit, size and start on `turn_planner.py`'s
  thread, stream, finish);
- `history_edits.py`: create, rename, archive, delete, fork, edit-and-resend, the
  system prompt, sampling;
- `type_ahead.py`: the type-ahead computed while a message is typed;
- `persistence.py`: write-behind saving, its failures, the recovery file at close;
- `service_worker.py`: the worker thread that applies engine events and writes.

Token ids are the heart of it (see `session.py`): the next prompt is the stored
ids plus the renderer's continuation, never a re-render of old turns; how each
turn's prompt is planned is `prompt_plan.py`, and a session's rows in the store
are `session_records.py`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

from kvchat.chat.engine_port import EnginePort, RendererPort, TurnPort, turn_port
from kvchat.chat.events import ChatEvent, SessionNotice
from kvchat.chat.history_edits import HistoryEdits
from kvchat.chat.live_sessions import LiveSessions, SessionBackend, Subscriber
from kvchat.chat.persistence import Persistence
from kvchat.chat.prompt_plan import reply_reserve
from kvchat.chat.recovery import UnsavedReport
from kvchat.chat.search import SearchHit, search_sessions
from kvchat.chat.service_worker import ServiceWorker
from kvchat.chat.session import MessageView, SessionSnapshot, SessionView, session_markdown
from kvchat.chat.session_numbers import number_loaded
from kvchat.chat.session_records import session_from_records
from kvchat.chat.session_runtime import SessionRuntime
from kvchat.chat.store import Store
from kvchat.chat.turn_planner import TurnPlanner
from kvchat.chat.turns import Turns
from kvchat.chat.type_ahead import TypeAhead
from kvchat.engine.api import Residency, SamplingParams
from kvchat.errors import KvchatError

MODEL_CHANGED_NOTICE = (
    "This session was computed with another model: its history will be computed again "
    "at the next turn."
)


class SessionService:
    """Sessions over one engine and one store; safe to call from any thread."""

    def __init__(
        self,
        engine: TurnPort | EnginePort,
        renderer: RendererPort,
        store: Store,
        *,
        stop_token_ids: Iterable[int] = (),
        default_sampling: SamplingParams | None = None,
        default_max_tokens: int = 512,
        save_interval_s: float = 0.25,
        save_every_tokens: int = 16,
        model_name: str = "",
    ) -> None:
        self._live = LiveSessions(
            SessionBackend(
                turn_port(engine),
                renderer,
                frozenset(stop_token_ids),
                default_sampling or SamplingParams(),
                default_max_tokens,
                model_name,
            )
        )
        self._persistence = Persistence(store, self._live)
        self._worker = ServiceWorker(
            retry=self._persistence.drain, retrying=lambda: self._persistence.error is not None
        )
        self._persistence.request_drain = lambda: self._worker.put(self._persistence.drain)
        self._planner = TurnPlanner()
        self._type_ahead = TypeAhead(self._live, self._worker)
        self._turns = Turns(
            self._live,
            self._persistence,
            self._worker,
            self._planner,
            self._type_ahead,
            save_interval_s=save_interval_s,
            save_every_tokens=save_every_tokens,
        )
        self._edits = HistoryEdits(self._live, self._persistence, self._turns, self._type_ahead)
        self._load(store)
        self._worker.start()
        self._planner.start()

    # ----------------------------------------------------------------- lifecycle

    def _load(self, store: Store) -> None:
        live = self._live
        store.purge_deleted(before=time.time())  # undo lasts until the next start
        fingerprint = live.backend.engine.model_fingerprint
        for record, rows in store.load():
            session = session_from_records(record, rows)
            self._persistence.seen(record.id, record.revision)
            runtime = SessionRuntime()
            if session.messages and session.model_fingerprint != fingerprint:
                session.ids_stale = True
                runtime.notice = MODEL_CHANGED_NOTICE
            for m in reversed(session.messages):
                if m.stats is not None:
                    runtime.last_stats = m.stats
                    break
            live.sessions[session.id] = session
            live.runtime[session.id] = runtime
        for session in number_loaded(live.sessions.values()):
            self._persistence.persist(session)

    def replace_backend(
        self,
        engine: TurnPort | EnginePort,
        renderer: RendererPort,
        *,
        stop_token_ids: Iterable[int] = (),
        default_sampling: SamplingParams | None = None,
        default_max_tokens: int | None = None,
        model_name: str = "",
    ) -> None:
        """Run every later turn on another engine (another model), without a restart.

        Refused while a reply is under way (it belongs to the old engine). Type-aheads end;
        sessions computed with another model get the notice and their history rendered
        again at their next turn, as at a start with another model. The caller closes
        the old engine afterwards."""
        live = self._live
        with live.lock:
            busy = [rt for rt in live.runtime.values() if rt.busy]
            if busy:
                raise KvchatError(
                    f"{len(busy)} session(s) still have a reply on the way: let them finish "
                    "(or stop them with esc) before switching models."
                )
            events: list[ChatEvent] = []
            for session_id in live.runtime:
                events += self._type_ahead.end_locked(session_id)
            old = live.backend
            live.backend = SessionBackend(
                turn_port(engine),
                renderer,
                frozenset(stop_token_ids),
                default_sampling if default_sampling is not None else old.default_sampling,
                default_max_tokens if default_max_tokens is not None else old.default_max_tokens,
                model_name,
            )
            fingerprint = live.backend.engine.model_fingerprint
            for session in live.sessions.values():
                if session.messages and session.model_fingerprint != fingerprint:
                    session.ids_stale = True
                    live.runtime[session.id].notice = MODEL_CHANGED_NOTICE
                events.append(live.changed(session.id))
        live.publish(events)

    def close(self, timeout: float | None = 10.0) -> UnsavedReport | None:
        """Start the turns being sized, cancel live replies, write what is pending, stop
        the threads, close the store.

        A turn sent to an idle session just before closing is stored (its reply is cut
        and kept); turns queued behind a running reply are dropped. Returns None when
        everything is stored; else what could not be, written to a recovery file in the
        database's folder (or the temporary folder).
        """
        live = self._live
        with live.lock:
            for rt in live.runtime.values():
                rt.queue.clear()
        self._planner.flush(timeout)  # a turn being sized starts (cancelled below)
        self._worker.flush(timeout)
        with live.lock:
            live_ids = [r.request_id for r in live.runtime.values() if r.request_id is not None]
            live_ids += [
                r.type_ahead.request_id for r in live.runtime.values() if r.type_ahead.request_id
            ]
            for rt in live.runtime.values():
                rt.queue.clear()
                rt.type_ahead.clear()
        for request_id in live_ids:
            with contextlib.suppress(Exception):
                live.backend.engine.cancel(request_id)
        self.flush(timeout)
        self._planner.stop(timeout)
        self._worker.stop(timeout)
        return self._persistence.close()

    @property
    def save_error(self) -> str | None:
        """The database's current write failure (None while writes succeed)."""
        return self._persistence.error

    def unsaved_messages(self) -> int:
        """Messages waiting to be stored (nonzero while the database refuses writes)."""
        return self._persistence.unsaved_messages()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every turn submitted, event and write queued so far has been handled
        (a turn sized and started, or refused)."""
        return self._planner.flush(timeout) and self._worker.flush(timeout)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until every turn submitted so far has been sized and handed to the engine,
        or refused; unlike `flush`, not for the events and writes that follow (at once when
        `say` sized its turn on the caller's thread)."""
        return self._planner.flush(timeout)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback` for every event (from any thread); returns the unsubscribe function."""
        return self._live.subscribe(callback)

    # ----------------------------------------------------------------- queries

    @property
    def engine(self) -> TurnPort:
        return self._live.backend.engine

    def list_sessions(self, *, include_archived: bool = False) -> list[SessionView]:
        """Live sessions, most recently updated first (soft-deleted ones never)."""
        live = self._live
        with live.lock:
            views = [
                live.view(s)
                for s in live.sessions.values()
                if s.deleted_at is None and (include_archived or not s.archived)
            ]
        return sorted(views, key=lambda v: v.updated, reverse=True)

    def session(self, session_id: str) -> SessionView:
        with self._live.lock:
            return self._live.view(self._live.get(session_id))

    def messages(self, session_id: str) -> list[MessageView]:
        with self._live.lock:
            return list(self._live.messages(session_id))

    def snapshot(self, session_id: str) -> SessionSnapshot:
        """The session's view and messages, taken together."""
        with self._live.lock:
            return self._live.snapshot(session_id)

    def search(
        self, query: str, *, limit: int = 30, include_archived: bool = False
    ) -> list[SearchHit]:
        """Where `query` occurs in the listed sessions' titles and messages (`chat/search.py`),
        the most recently updated sessions first."""
        with self._live.lock:
            sessions = sorted(
                (
                    s
                    for s in self._live.sessions.values()
                    if s.deleted_at is None and (include_archived or not s.archived)
                ),
                key=lambda s: s.updated,
                reverse=True,
            )
            return search_sessions(sessions, query, limit=limit)

    def token_ids(self, session_id: str) -> tuple[int, ...]:
        """The stored ids of the session's rendered history (the prompt while replying)."""
        with self._live.lock:
            return tuple(self._live.get(session_id).ids)

    def residency(self, session_id: str) -> Residency:
        """How much of the session's history is on the device, the host, or nowhere."""
        with self._live.lock:
            session = self._live.get(session_id)
            ids = tuple(session.ids)
            stale = session.ids_stale
        if stale or not ids:
            return Residency(nowhere=len(ids))
        return self.engine.residency(ids)

    def export_markdown(self, session_id: str) -> str:
        with self._live.lock:
            return session_markdown(self._live.get(session_id))

    def message_size(self, session_id: str, text: str) -> tuple[int, int]:
        """(tokens, room) for a message of `text` before it is sent: its tokens rendered
        alone after the session's system prompt, and the most a prompt may hold (the
        model's context less the reply's reserve). An attachment's cost is known at once,
        not at the send that fails. Renders outside the lock (a server's is HTTP)."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            head = [m.as_chat() for m in session.context_messages()[:1] if m.role == "system"]
            max_tokens = session.max_tokens or live.backend.default_max_tokens
            backend = live.backend
        context = backend.engine.context_length
        tokens = len(backend.renderer.prompt_ids([*head, {"role": "user", "content": text}]))
        return tokens, context - reply_reserve(max_tokens, context)

    def wait_idle(self, session_id: str | None = None, timeout: float | None = None) -> bool:
        """Block until that session (None: every session) has no turn running, being sized
        or queued, and what its last turn announced (its `ReplyFinished`, or its
        `SessionFailed`) was published."""
        live = self._live

        def idle() -> bool:
            if session_id is not None:
                return not live.runtime[session_id].busy and session_id not in live.announcing
            return not any(r.busy for r in live.runtime.values()) and not live.announcing

        with live.idle:
            if session_id is not None:
                live.get(session_id)
            return live.idle.wait_for(idle, timeout)

    # --------------------------------------------------------------- commands

    def focus(self, session_id: str) -> None:
        """The user looks at this session now: clear its unread flag, prefetch its pages."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            live.focused = session_id
            live.runtime[session_id].unread = False
            ids = () if session.ids_stale else tuple(session.ids)
            event = live.changed(session_id)
        if ids:
            self.engine.prefetch(ids)
        live.publish([event])

    def notice(self, session_id: str, text: str) -> None:
        """Tell subscribers something about a session (shown by the UI, kept in its view)."""
        live = self._live
        with live.lock:
            live.runtime[live.get(session_id).id].notice = text
            event = SessionNotice(session_id, text, live.snapshot(session_id))
        live.publish([event])

    def say(
        self,
        session_id: str,
        text: str,
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        title: str | None = None,
    ) -> int:
        """Submit a user message and return: its reply starts once its prompt is sized
        (`turns.py`) and the session's reply before it ended. `title` renames the session
        when it starts (a new chat named after its first message).

        Returns the turn's number; a turn that cannot start (e.g. its prompt does not fit)
        publishes `SessionFailed` with that number and changes nothing. Raises
        `KvchatError` only for an unknown session.
        """
        return self._turns.say(
            session_id,
            text,
            sampling=sampling,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            title=title,
        )

    def stop(self, session_id: str) -> None:
        """Cancel the running reply (queued turns then start, in order)."""
        self._turns.stop(session_id)

    def regenerate(self, session_id: str) -> int:
        """Replace the last reply: the same prompt ids again (a full cache hit). A turn like
        a say: submitted, sized and started on the service's threads; returns its number."""
        return self._turns.regenerate(session_id)

    def edit_last_user_message(self, session_id: str, text: str) -> int:
        """Edit-and-resend: cut the ids where the last user message began, say `text`.
        Raises `KvchatError` at once when there is nothing to edit or a reply runs; a
        resend that cannot start publishes `SessionFailed` as a say does."""
        return self._edits.edit_last_user_message(session_id, text)

    def type_ahead(self, session_id: str, text: str) -> None:
        """Compute the user's unsent message ahead (`type_ahead.py`); "" ends the type-ahead."""
        self._type_ahead.update(session_id, text)

    def end_type_ahead(self, session_id: str) -> None:
        """Stop computing the session's type-ahead (its computed pages stay cached)."""
        self._type_ahead.end(session_id)

    def type_ahead_progress(self, session_id: str) -> tuple[int, int]:
        """(tokens ready, tokens in the type-ahead); (0, 0) without one."""
        return self._type_ahead.progress(session_id)

    def keep_unsent(self, session_id: str, text: str) -> None:
        """Store the composer's unsent text with the session (switches, restarts, crashes)."""
        self._edits.keep_unsent(session_id, text)

    def create_session(
        self,
        title: str = "New chat",
        *,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> str:
        return self._edits.create_session(
            title, system=system, sampling=sampling, max_tokens=max_tokens
        )

    def rename(self, session_id: str, title: str) -> None:
        self._edits.rename(session_id, title)

    def set_archived(self, session_id: str, archived: bool = True) -> None:
        self._edits.set_archived(session_id, archived)

    def delete(self, session_id: str) -> None:
        """Soft delete: hidden now, kept until `undo_delete` or the next start."""
        self._edits.delete(session_id)

    def undo_delete(self, session_id: str) -> None:
        self._edits.undo_delete(session_id)

    def set_sampling(
        self, session_id: str, sampling: SamplingParams, max_tokens: int | None = None
    ) -> None:
        """The session's own sampling parameters (and max_tokens) for its next turns."""
        self._edits.set_sampling(session_id, sampling, max_tokens)

    def set_system_prompt(self, session_id: str, text: str | None) -> None:
        """Change (or remove, with None/"") the system prompt: the ids are cut at 0."""
        self._edits.set_system_prompt(session_id, text)

    def fork(self, session_id: str, at_message: int, title: str | None = None) -> str:
        """A new session with the messages before `at_message` (a user message, or the end),
        sharing the source's cached pages."""
        return self._edits.fork(session_id, at_message, title)
