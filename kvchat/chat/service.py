"""`SessionService`: owns the sessions, talks to the engine, persists, publishes events.

The one code path for conversations: the TUI and the headless mode both drive
this class. Engine callbacks arrive on the engine thread and are only queued
there; one worker thread applies them, writes SQLite (write-behind, so neither
the engine thread nor the UI thread waits on the disk; `write_behind.py` keeps
and retries what the database refuses, and `close` writes what is still unsaved
to a recovery file) and calls subscribers.
Commands (`say`, `rename`, ...) may come from any thread; a lock guards the
sessions and subscribers are always called outside it.

Token ids are the heart of it (see `session.py`): the next prompt is the stored
ids plus the renderer's continuation, never a re-render of old turns; how each
turn's prompt is planned (cut ids, drop the oldest turns) is `prompt_plan.py`,
and a session's rows in the store are `session_records.py`.

`SessionService` stays one class on purpose: its commands, the engine's events
and the worker all change the same sessions under one lock, and the order in
which they do (a reply stored before it is announced, a queued `say` started when
the previous reply ends) is the service's contract.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvchat.chat.drafts import SessionDraft, draft_prompt
from kvchat.chat.engine_port import (
    EnginePort,
    RendererPort,
    Turn,
    TurnFinished,
    TurnPort,
    turn_port,
)
from kvchat.chat.events import (
    ChatEvent,
    DraftChanged,
    ReplyDelta,
    ReplyFinished,
    ReplyStarted,
    SaveFailed,
    SaveRecovered,
    SessionArchived,
    SessionChanged,
    SessionCreated,
    SessionDeleted,
    SessionFailed,
    SessionNotice,
    SessionRenamed,
)
from kvchat.chat.prompt_plan import (
    PromptPlan,
    cut_ids,
    plan_prompt,
    reply_reserve,
    reset_offsets,
)
from kvchat.chat.recovery import UnsavedReport, write_recovery
from kvchat.chat.search import SearchHit, search_sessions
from kvchat.chat.session import (
    Message,
    MessageState,
    MessageView,
    Session,
    SessionView,
    TurnState,
    TurnStats,
    session_markdown,
)
from kvchat.chat.session_numbers import number_loaded, number_new
from kvchat.chat.session_records import message_records, session_from_records, session_record
from kvchat.chat.store import Store
from kvchat.chat.write_behind import WriteBehind
from kvchat.engine.api import (
    DraftProgress,
    EngineEvent,
    FinishReason,
    PrefillProgress,
    RequestFinished,
    RequestStarted,
    Residency,
    SamplingParams,
    TokenGenerated,
    common_prefix,
)
from kvchat.errors import KvchatError

log = logging.getLogger("kvchat.chat")

IDLE = TurnState.IDLE
MODEL_CHANGED_NOTICE = (
    "This session was computed with another model: its history will be computed again "
    "at the next turn."
)

DIVERGED_NOTICE = (
    "Another kvchat process also wrote to this session: every message of both is saved; "
    "restart kvchat to see them all here."
)
RETRY_SAVE_S = 2.0  # while the database refuses writes, try again this often

Subscriber = Callable[[ChatEvent], None]


@dataclass(frozen=True)
class _Say:
    text: str
    sampling: SamplingParams | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False


@dataclass
class _Runtime:
    """Per-session state that is not persisted: the live request and UI flags."""

    request_id: int | None = None
    state: TurnState = IDLE
    message: Message | None = None  # the assistant message being written
    turn: int = 0
    generated: list[int] = field(default_factory=list)
    queue: deque[_Say] = field(default_factory=deque)
    unread: bool = False
    notice: str | None = None
    last_stats: TurnStats | None = None
    unsaved_tokens: int = 0
    last_save: float = 0.0
    draft: SessionDraft = field(default_factory=SessionDraft)
    planning: bool = False  # a say's prompt is being sized outside the lock

    @property
    def busy(self) -> bool:
        return self.state != IDLE or bool(self.queue) or self.planning


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
        self._engine = turn_port(engine)
        self._model_name = model_name  # as it was asked for (--model); "": not known
        self._renderer = renderer
        self._store = store
        self._stop_ids = frozenset(stop_token_ids)
        self._default_sampling = default_sampling or SamplingParams()
        self._default_max_tokens = default_max_tokens
        self._save_interval_s = save_interval_s
        self._save_every_tokens = save_every_tokens
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._subscribers: list[Subscriber] = []
        self._sessions: dict[str, Session] = {}
        self._runtime: dict[str, _Runtime] = {}
        self._focused: str | None = None
        self._announcing: set[str] = set()  # finished replies being stored, then published
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._writes = WriteBehind(store)
        self._reported: tuple[str, int] | None = None  # the save failure last published
        self._load()
        self._worker = threading.Thread(target=self._work, name="kvchat-sessions", daemon=True)
        self._worker.start()

    # ----------------------------------------------------------------- lifecycle

    def _load(self) -> None:
        self._store.purge_deleted(before=time.time())  # undo lasts until the next start
        fingerprint = self._engine.model_fingerprint
        for record, rows in self._store.load():
            session = session_from_records(record, rows)
            self._writes.seen(record.id, record.revision)
            runtime = _Runtime()
            if session.messages and session.model_fingerprint != fingerprint:
                session.ids_stale = True
                runtime.notice = MODEL_CHANGED_NOTICE
            for m in reversed(session.messages):
                if m.stats is not None:
                    runtime.last_stats = m.stats
                    break
            self._sessions[session.id] = session
            self._runtime[session.id] = runtime
        for session in number_loaded(self._sessions.values()):
            self._persist(session)

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

        Refused while a reply is under way (it belongs to the old engine). Drafts end;
        sessions computed with another model get the notice and their history rendered
        again at their next turn, as at a start with another model. The caller closes
        the old engine afterwards."""
        with self._lock:
            busy = [rt for rt in self._runtime.values() if rt.busy]
            if busy:
                raise KvchatError(
                    f"{len(busy)} session(s) still have a reply on the way: let them finish "
                    "(or stop them with esc) before switching models."
                )
            events: list[ChatEvent] = []
            for session_id in self._runtime:
                events += self._end_draft(session_id)
            self._engine = turn_port(engine)
            self._model_name = model_name
            self._renderer = renderer
            self._stop_ids = frozenset(stop_token_ids)
            if default_sampling is not None:
                self._default_sampling = default_sampling
            if default_max_tokens is not None:
                self._default_max_tokens = default_max_tokens
            fingerprint = self._engine.model_fingerprint
            for session in self._sessions.values():
                if session.messages and session.model_fingerprint != fingerprint:
                    session.ids_stale = True
                    self._runtime[session.id].notice = MODEL_CHANGED_NOTICE
                events.append(SessionChanged(session.id))
        self._publish(events)

    def close(self, timeout: float | None = 10.0) -> UnsavedReport | None:
        """Cancel live replies, write what is pending, stop the worker, close the store.

        Returns None when everything is stored; else what could not be, written to a
        recovery file in the database's folder (or the temporary folder).
        """
        with self._lock:
            live = [r.request_id for r in self._runtime.values() if r.request_id is not None]
            live += [r.draft.draft_id for r in self._runtime.values() if r.draft.draft_id]
            for rt in self._runtime.values():
                rt.queue.clear()
                rt.draft.clear()
        for request_id in live:
            with contextlib.suppress(Exception):
                self._engine.cancel(request_id)
        self.flush(timeout)
        self._tasks.put(None)
        self._worker.join(timeout)
        report = None
        if self._writes.has_pending():
            self._writes.drain()  # a last try: the fault may have cleared
            folders = [] if self._store.path == ":memory:" else [Path(self._store.path).parent]
            report = write_recovery(
                self._writes.pending(), self._store.path, self._writes.error, folders
            )
            if report is not None:
                log.error("unsaved messages at exit: %s", report.summary())
        with contextlib.suppress(Exception):
            self._store.close()
        return report

    @property
    def save_error(self) -> str | None:
        """The database's current write failure (None while writes succeed)."""
        return self._writes.error

    def unsaved_messages(self) -> int:
        """Messages waiting to be stored (nonzero while the database refuses writes)."""
        return self._writes.unsaved_messages()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event and write queued so far has been handled."""
        done = threading.Event()
        self._tasks.put(done.set)
        return done.wait(timeout)

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=RETRY_SAVE_S if self._writes.error else None)
            except queue.Empty:
                task = self._drain  # the retry of a failed write
            if task is None:
                return
            try:
                task()
            except Exception:  # a bug: log it, keep serving the other sessions
                log.exception("session worker task failed")

    def _drain(self) -> None:
        """Worker thread: store what waits; tell subscribers when that fails or works again."""
        if not self._writes.has_pending():
            return
        before = self._writes.error
        result = self._writes.drain()
        events: list[ChatEvent] = []
        if result.error is not None:
            if before is None:
                log.error("writing the session database failed: %s", result.error)
            reported = (result.error, result.unsaved_messages)
            if reported != self._reported:
                self._reported = reported
                events.append(SaveFailed(result.error, result.unsaved_messages))
        elif before is not None:
            self._reported = None
            log.warning("writing the session database works again")
            events.append(SaveRecovered())
        for session_id in result.diverged:
            with self._lock:
                if session_id in self._runtime:
                    self._runtime[session_id].notice = DIVERGED_NOTICE
            events.append(SessionNotice(session_id, DIVERGED_NOTICE))
        self._publish(events)

    # ---------------------------------------------------------------- events

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback` for every event (from any thread); returns the unsubscribe function."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._subscribers.remove(callback)

        return unsubscribe

    def _publish(self, events: Iterable[ChatEvent]) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:
                    log.exception("a session event subscriber failed")

    # ----------------------------------------------------------------- queries

    @property
    def engine(self) -> TurnPort:
        return self._engine

    def list_sessions(self, *, include_archived: bool = False) -> list[SessionView]:
        """Live sessions, most recently updated first (soft-deleted ones never)."""
        with self._lock:
            views = [
                self._view(s)
                for s in self._sessions.values()
                if s.deleted_at is None and (include_archived or not s.archived)
            ]
        return sorted(views, key=lambda v: v.updated, reverse=True)

    def session(self, session_id: str) -> SessionView:
        with self._lock:
            return self._view(self._get(session_id))

    def messages(self, session_id: str) -> list[MessageView]:
        with self._lock:
            session = self._get(session_id)
            return [
                MessageView(m.id, i, m.role, m.content, m.state, m.in_context, m.stats)
                for i, m in enumerate(session.messages)
            ]

    def search(
        self, query: str, *, limit: int = 30, include_archived: bool = False
    ) -> list[SearchHit]:
        """Where `query` occurs in the listed sessions' titles and messages (`chat/search.py`),
        the most recently updated sessions first."""
        with self._lock:
            sessions = sorted(
                (
                    s
                    for s in self._sessions.values()
                    if s.deleted_at is None and (include_archived or not s.archived)
                ),
                key=lambda s: s.updated,
                reverse=True,
            )
            return search_sessions(sessions, query, limit=limit)

    def token_ids(self, session_id: str) -> tuple[int, ...]:
        """The stored ids of the session's rendered history (the prompt while replying)."""
        with self._lock:
            return tuple(self._get(session_id).ids)

    def residency(self, session_id: str) -> Residency:
        """How much of the session's history is on the device, the host, or nowhere."""
        with self._lock:
            session = self._get(session_id)
            ids = tuple(session.ids)
            stale = session.ids_stale
        if stale or not ids:
            return Residency(nowhere=len(ids))
        return self._engine.residency(ids)

    def export_markdown(self, session_id: str) -> str:
        with self._lock:
            return session_markdown(self._get(session_id))

    def wait_idle(self, session_id: str | None = None, timeout: float | None = None) -> bool:
        """Block until that session (None: every session) has no reply running or queued,
        and its last reply's `ReplyFinished` was published."""

        def idle() -> bool:
            if session_id is not None:
                return not self._runtime[session_id].busy and session_id not in self._announcing
            return not any(r.busy for r in self._runtime.values()) and not self._announcing

        with self._idle:
            if session_id is not None:
                self._get(session_id)
            return self._idle.wait_for(idle, timeout)

    def _get(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KvchatError(f"no session {session_id!r}") from None

    def _view(self, s: Session) -> SessionView:
        rt = self._runtime[s.id]
        return SessionView(
            id=s.id,
            title=s.title,
            state=rt.state,
            archived=s.archived,
            unread=rt.unread,
            queued_says=len(rt.queue),
            message_count=len(s.messages),
            context_tokens=None if s.ids_stale else len(s.ids) + len(rt.generated),
            context_length=self._engine.context_length,
            last_turn=rt.last_stats,
            system_prompt=s.system_prompt,
            sampling=s.sampling,
            max_tokens=s.max_tokens or self._default_max_tokens,
            model_fingerprint=s.model_fingerprint,
            notice=rt.notice,
            created=s.created,
            updated=s.updated,
            number=s.number,
            unsent=s.unsent,
            model_name=s.model_name,
        )

    # ------------------------------------------------------------ persistence

    def _persist(
        self,
        session: Session,
        messages: Iterable[Message] = (),
        *,
        removed: Iterable[str] = (),
        extra_ids: Iterable[int] = (),
    ) -> None:
        """Snapshot now (under the lock), write later on the worker thread.

        `messages` are the ones that changed (a new one is appended after every stored
        message, a new system prompt before them); `removed` are ids to delete.
        """
        record = session_record(session, extra_ids)
        records = message_records(session, messages)
        self._writes.add(record, records, list(removed))
        self._tasks.put(self._drain)

    # --------------------------------------------------------------- commands

    def create_session(
        self,
        title: str = "New chat",
        *,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
    ) -> str:
        now = time.time()
        session = Session(
            id=uuid.uuid4().hex,
            title=title,
            created=now,
            updated=now,
            model_fingerprint=self._engine.model_fingerprint,
            sampling=sampling or self._default_sampling,
            max_tokens=max_tokens,
        )
        if system:
            session.messages.append(_message("system", system))
        with self._lock:
            number_new(session, self._sessions.values())
            self._sessions[session.id] = session
            self._runtime[session.id] = _Runtime()
            self._persist(session, session.messages)
        self._publish([SessionCreated(session.id)])
        return session.id

    def rename(self, session_id: str, title: str) -> None:
        with self._lock:
            session = self._get(session_id)
            session.title = title
            self._touch_and_persist(session)
        self._publish([SessionRenamed(session_id, title)])

    def set_archived(self, session_id: str, archived: bool = True) -> None:
        with self._lock:
            session = self._get(session_id)
            session.archived = archived
            if not archived:
                number_new(session, self._sessions.values())
            self._touch_and_persist(session)
        self._publish([SessionArchived(session_id, archived)])

    def delete(self, session_id: str) -> None:
        """Soft delete: hidden now, kept until `undo_delete` or the next start."""
        with self._lock:
            session = self._get(session_id)
            rt = self._runtime[session_id]
            rt.queue.clear()
            request_id = rt.request_id
            session.deleted_at = time.time()
            self._persist(session)
            self._end_draft(session_id)
        if request_id is not None:
            self._engine.cancel(request_id)
        self._publish([SessionDeleted(session_id, True)])

    def undo_delete(self, session_id: str) -> None:
        with self._lock:
            session = self._get(session_id)
            session.deleted_at = None
            number_new(session, self._sessions.values())
            # every message again: another kvchat starting meanwhile purged the deleted rows
            self._persist(session, session.messages)
        self._publish([SessionDeleted(session_id, False)])

    def set_sampling(
        self, session_id: str, sampling: SamplingParams, max_tokens: int | None = None
    ) -> None:
        """The session's own sampling parameters (and max_tokens) for its next turns."""
        with self._lock:
            session = self._get(session_id)
            session.sampling = sampling
            session.max_tokens = max_tokens
            self._touch_and_persist(session)
        self._publish([SessionChanged(session_id)])

    def set_system_prompt(self, session_id: str, text: str | None) -> None:
        """Change (or remove, with None/"") the system prompt: the ids are cut at 0."""
        with self._lock:
            session = self._get(session_id)
            self._require_idle(session_id, "change the system prompt")
            removed: list[str] = []
            if session.system_prompt is not None:
                if text:
                    session.messages[0].content = text
                else:
                    removed.append(session.messages[0].id)
                    del session.messages[0]
            elif text:
                session.messages.insert(0, _message("system", text))
            session.ids, session.ids_stale = array("I"), True  # cut at 0: render it all
            for m in session.messages:
                m.offset = None
            self._touch_and_persist(session, session.messages, removed=removed)
        self._publish([SessionChanged(session_id)])

    def focus(self, session_id: str) -> None:
        """The user looks at this session now: clear its unread flag, prefetch its pages."""
        with self._lock:
            session = self._get(session_id)
            self._focused = session_id
            self._runtime[session_id].unread = False
            ids = () if session.ids_stale else tuple(session.ids)
        if ids:
            self._engine.prefetch(ids)
        self._publish([SessionChanged(session_id)])

    def say(
        self,
        session_id: str,
        text: str,
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
    ) -> None:
        """Append a user message and start its reply; queued if a reply is running.

        Raises `KvchatError` (e.g. `PromptTooLongError`) when it starts at once and
        cannot; a queued say that cannot start publishes `SessionFailed` instead.
        The prompt is sized outside the service's lock (`_plan_and_start`).
        """
        say = _Say(text, sampling, max_tokens, ignore_eos)
        with self._lock:
            rt = self._runtime[self._get(session_id).id]
            self._sessions[session_id].unsent = ""  # stored with the message
            if rt.busy:
                rt.queue.append(say)
                rt.draft.pending = None  # the text it held is sent now
                queued: list[ChatEvent] | None = [SessionChanged(session_id)]
            else:
                rt.planning = True
                queued = None
        self._publish(queued if queued is not None else self._plan_and_start(session_id, say))

    def draft(self, session_id: str, text: str) -> None:
        """Compute the user's unsent message ahead, at the engine's lowest priority.

        Rendered exactly as `say(text)` would render it, up to the end of the text,
        so the turn that sends it finds these pages cached. Replaces the session's
        previous draft (whose pages stay cached); an empty text ends it. While the
        session replies, the text waits for the reply's end. Subscribers get
        `DraftChanged` as the draft is computed.
        """
        with self._lock:
            session = self._get(session_id)
            rt = self._runtime[session_id]
            if not text.strip():
                events = self._end_draft(session_id)
            elif rt.busy:
                rt.draft.pending = text
                events = []
            else:
                events = self._submit_draft(session, rt, text)
        self._publish(events)

    def message_size(self, session_id: str, text: str) -> tuple[int, int]:
        """(tokens, room) for a message of `text` before it is sent: its tokens rendered
        alone after the session's system prompt, and the most a prompt may hold (the
        model's context less the reply's reserve). An attachment's cost is known at once,
        not at the send that fails. Renders outside the lock (a server's is HTTP)."""
        with self._lock:
            session = self._get(session_id)
            head = [m.as_chat() for m in session.context_messages()[:1] if m.role == "system"]
            max_tokens = session.max_tokens or self._default_max_tokens
        context = self._engine.context_length
        tokens = len(self._renderer.prompt_ids([*head, {"role": "user", "content": text}]))
        return tokens, context - reply_reserve(max_tokens, context)

    def keep_unsent(self, session_id: str, text: str) -> None:
        """Store what the user typed for the session and has not sent (its composer's
        text), so that it is there after a switch, a restart or a crash."""
        with self._lock:
            session = self._get(session_id)
            if session.unsent == text:
                return
            session.unsent = text
            self._persist(session)  # `updated` unchanged: typing does not reorder sessions

    def end_draft(self, session_id: str) -> None:
        """Stop computing the session's draft (its computed pages stay cached)."""
        with self._lock:
            self._get(session_id)
            events = self._end_draft(session_id)
        self._publish(events)

    def draft_progress(self, session_id: str) -> tuple[int, int]:
        """(tokens ready, tokens in the draft); (0, 0) without a draft."""
        with self._lock:
            d = self._runtime[self._get(session_id).id].draft
            return (d.ready, len(d.ids)) if d.draft_id is not None else (0, 0)

    def stop(self, session_id: str) -> None:
        """Cancel the running reply (queued says then start, in order)."""
        with self._lock:
            request_id = self._runtime[self._get(session_id).id].request_id
        if request_id is not None:
            self._engine.cancel(request_id)

    def regenerate(self, session_id: str) -> None:
        """Replace the last reply: the same prompt ids again (a full cache hit)."""
        with self._lock:
            session = self._get(session_id)
            self._require_idle(session_id, "regenerate")
            k = len(session.messages) - 1
            if k < 0 or session.messages[k].role != "assistant":
                raise KvchatError("there is no reply to regenerate")
            if session.messages[k - 1].role != "user":
                raise KvchatError("the last reply does not follow a user message")
            cut_ok = cut_ids(session, k)
            removed = [m.id for m in session.messages[k:]]
            del session.messages[k:]
            if not cut_ok:
                session.ids = array(
                    "I",
                    self._renderer.prompt_ids([m.as_chat() for m in session.context_messages()]),
                )
                session.ids_stale = False
                reset_offsets(session.context_messages())
            session.updated = time.time()
            events = self._start_reply(
                session, _Say(""), also=list(session.messages), removed=removed
            )
        self._publish(events)

    def edit_last_user_message(self, session_id: str, text: str) -> None:
        """Edit-and-resend: cut the ids where the last user message began, say `text`."""
        with self._lock:
            session = self._get(session_id)
            self._require_idle(session_id, "edit the last message")
            users = [i for i, m in enumerate(session.messages) if m.role == "user"]
            if not users:
                raise KvchatError("there is no message of yours to edit")
            k = users[-1]
            self._runtime[session_id].planning = True

        def cut(s: Session) -> list[str]:
            """Cut `s` at message k (planned on a copy; done to the session once it fits)."""
            cut_ids(s, k)
            removed = [m.id for m in s.messages[k:]]
            del s.messages[k:]
            return removed

        self._publish(self._plan_and_start(session_id, _Say(text), prepare=cut))

    def fork(self, session_id: str, at_message: int, title: str | None = None) -> str:
        """A new session with the messages before `at_message` (a user message, or the end).

        It copies the ids up to that point, so its first turn shares the source's
        cached pages.
        """
        with self._lock:
            source = self._get(session_id)
            n = len(source.messages)
            if not 0 <= at_message <= n:
                raise KvchatError(f"cannot fork at message {at_message}: it has {n} messages")
            if at_message < n and source.messages[at_message].role != "user":
                raise KvchatError("fork at one of your messages (or at the end)")
            if at_message == n:
                self._require_idle(session_id, "fork at the end")
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
            number_new(fork, self._sessions.values())
            self._sessions[fork.id] = fork
            self._runtime[fork.id] = _Runtime(last_stats=self._runtime[session_id].last_stats)
            self._persist(fork, fork.messages)
        self._publish([SessionCreated(fork.id)])
        return fork.id

    # --------------------------------------------------------------- internals

    def _require_idle(self, session_id: str, what: str) -> None:
        if self._runtime[session_id].busy:
            raise KvchatError(f"cannot {what} while the session is replying; stop it first")

    def _touch_and_persist(self, session: Session, messages: Iterable[Message] = (), **kw) -> None:
        session.updated = time.time()
        self._persist(session, messages, **kw)

    # Sizing a turn's prompt (`plan_prompt`) calls the renderer, which for a server is
    # HTTP (/apply-template, /tokenize): never under the lock, where a slow server would
    # stall every other session's events and every query of the UI. The session is
    # marked `planning` (busy) meanwhile, so nothing else changes its messages or ids;
    # the plan is made on a copy and applied under the lock.

    def _plan_say(
        self, session_id: str, say: _Say, prepare: Callable[[Session], list[str]] | None = None
    ) -> tuple[Message, PromptPlan]:
        """The user message and its prompt plan, sized outside the lock. Raises KvchatError."""
        with self._lock:
            session = self._sessions[session_id]
            copy = _planning_copy(session)
            max_tokens = say.max_tokens or session.max_tokens or self._default_max_tokens
        if prepare is not None:
            prepare(copy)
        user = _message("user", say.text)
        plan = plan_prompt(copy, user, max_tokens, self._renderer, self._engine.context_length)
        return user, plan

    def _plan_and_start(
        self, session_id: str, say: _Say, prepare: Callable[[Session], list[str]] | None = None
    ) -> list[ChatEvent]:
        """Caller's thread, the session marked planning: size `say`, then start its reply.

        `prepare` (an edit's cut) is applied to the copy that is planned on, then to the
        session itself once the plan fits; it returns the ids of the messages it removed.
        Raises what planning raised (the session unchanged; says queued meanwhile go on).
        """
        rt = self._runtime[session_id]
        try:
            user, plan = self._plan_say(session_id, say, prepare)
        except BaseException:
            with self._lock:
                rt.planning = False
                events = self._start_next_queued(session_id)
                self._idle.notify_all()
            self._publish(events)
            raise
        with self._lock:
            rt.planning = False
            session = self._sessions[session_id]
            removed = prepare(session) if prepare is not None else []
            return self._start_planned(session_id, say, user, plan, removed)

    def _plan_queued(self, session_id: str, say: _Say) -> None:
        """Planner thread: size a queued say outside the lock; the worker then starts it."""
        planned: tuple[Message, PromptPlan] | KvchatError
        try:
            planned = self._plan_say(session_id, say)
        except KvchatError as exc:
            planned = exc
        except Exception as exc:  # a renderer's failure: this say fails, the next ones go on
            log.exception("sizing a queued turn failed")
            planned = KvchatError(f"could not start the turn: {exc}")
        self._tasks.put(lambda: self._start_queued(session_id, say, planned))

    def _start_queued(
        self, session_id: str, say: _Say, planned: tuple[Message, PromptPlan] | KvchatError
    ) -> None:
        """Worker thread: start the queued say that `planned` sized, or report its failure.

        On the worker, so its `ReplyStarted` follows the previous reply's `ReplyFinished`
        and precedes its own reply's events, as when it was started in that same task.
        """
        events: list[ChatEvent] = []
        with self._lock:
            rt = self._runtime[session_id]
            rt.planning = False
            if rt.queue and rt.queue[0] is say:  # else the queue was cleared (delete, close)
                rt.queue.popleft()
                if isinstance(planned, KvchatError):
                    events.append(SessionFailed(session_id, str(planned)))
                else:
                    events += self._start_planned(session_id, say, *planned, removed=[])
            events += self._start_next_queued(session_id)
            self._idle.notify_all()
        self._publish(events)

    def _start_planned(
        self, session_id: str, say: _Say, user: Message, plan: PromptPlan, removed: list[str]
    ) -> list[ChatEvent]:
        """Append the user message, apply its plan and start the reply (lock held)."""
        session = self._sessions[session_id]
        draft_events = self._end_draft(session_id)
        dropped = {m.id for m in plan.dropped}  # messages of the copy: matched by id
        for m in session.messages:
            if m.id in dropped:
                m.in_context = False
                m.offset = None
        if plan.full_render:
            reset_offsets(session.context_messages())
        user.offset = plan.new_offset
        session.messages.append(user)
        session.ids = array("I", plan.prompt)
        session.ids_stale = False
        changed = list(session.messages) if plan.full_render else [user]
        session.updated = time.time()
        return draft_events + self._start_reply(session, say, also=changed, removed=removed)

    def _start_reply(
        self,
        session: Session,
        say: _Say,
        also: Iterable[Message] = (),
        removed: Iterable[str] = (),
    ) -> list:
        """Submit session.ids as the prompt; the assistant message streams into the store.

        `also` (the user message) is saved in the same transaction as the reply's
        message, so another process's turn never lands between them.
        """
        rt = self._runtime[session.id]
        messages = tuple(m.as_chat() for m in session.context_messages())
        assistant = _message("assistant", "", state=MessageState.STREAMING)
        assistant.offset = len(session.ids)
        session.messages.append(assistant)
        session.model_fingerprint = self._engine.model_fingerprint
        if self._model_name:
            session.model_name = self._model_name
        rt.message, rt.generated, rt.unsaved_tokens = assistant, [], 0
        rt.turn = session.turn_count()
        rt.state = TurnState.QUEUED
        rt.last_save = time.monotonic()
        rt.notice = None
        self._persist(session, [*also, assistant], removed=removed)
        events: list[ChatEvent] = [ReplyStarted(session.id, assistant.id, rt.turn)]
        turn = Turn(
            session_id=session.id,
            messages=messages,
            prompt_ids=tuple(session.ids),
            sampling=say.sampling or session.sampling,
            max_tokens=say.max_tokens or session.max_tokens or self._default_max_tokens,
            stop_token_ids=self._stop_ids,
            ignore_eos=say.ignore_eos,
        )
        sid, mid = session.id, assistant.id

        def on_event(event: EngineEvent) -> None:  # engine thread: hand over only
            self._tasks.put(lambda: self._on_engine_event(sid, mid, event))

        try:
            rt.request_id = self._engine.submit_turn(turn, on_event)
        except Exception as exc:  # the engine refused or failed: this reply is an error
            log.exception("engine submit failed")
            finished = self._finish(session, rt, TurnStats.failed(str(exc)), (), "")
            events.append(finished)
        return events

    def _on_engine_event(self, session_id: str, message_id: str, event: EngineEvent) -> None:
        """Worker thread: apply one engine event to its session."""
        events: list[ChatEvent] = []
        with self._lock:
            session = self._sessions.get(session_id)
            rt = self._runtime.get(session_id)
            if session is None or rt is None or rt.message is None or rt.message.id != message_id:
                return  # a reply we no longer track
            if isinstance(event, RequestStarted | PrefillProgress):
                if rt.state != TurnState.PREFILLING:
                    rt.state = TurnState.PREFILLING
                    events.append(SessionChanged(session_id))
            elif isinstance(event, TokenGenerated):
                if rt.state != TurnState.DECODING:
                    rt.state = TurnState.DECODING
                    events.append(SessionChanged(session_id))
                rt.message.content += event.text
                rt.generated.extend(event.token_ids)
                rt.unsaved_tokens += len(event.token_ids)
                now = time.monotonic()
                if (
                    rt.unsaved_tokens >= self._save_every_tokens
                    or now - rt.last_save >= self._save_interval_s
                ):
                    self._persist(session, [rt.message], extra_ids=rt.generated)
                    rt.unsaved_tokens, rt.last_save = 0, now
                events.append(ReplyDelta(session_id, message_id, event.text, event.token_ids))
            elif isinstance(event, RequestFinished):
                text = event.text or rt.message.content
                cut = isinstance(event, TurnFinished) and event.interrupted
                stats = TurnStats.from_finished(event)
                events.append(
                    self._finish(session, rt, stats, event.generated_ids, text, interrupted=cut)
                )
                events.extend(self._start_next_queued(session_id))
                self._announcing.add(session_id)
        try:
            if any(isinstance(e, ReplyFinished) for e in events):
                # stored before anyone is told: a reply printed or shown as finished
                # survives a kill -9 the moment after
                self._drain()
            self._publish(events)
        finally:
            if isinstance(event, RequestFinished):
                with self._idle:
                    self._announcing.discard(session_id)
                    self._idle.notify_all()

    def _finish(
        self,
        session: Session,
        rt: _Runtime,
        stats: TurnStats,
        generated_ids: tuple[int, ...],
        text: str,
        *,
        interrupted: bool = False,
    ) -> ReplyFinished:
        """End the live reply (lock held). `interrupted`: the backend's stream broke after
        text arrived; the partial reply is kept as an interrupted message."""
        message = rt.message
        assert message is not None  # only called with a live reply
        reason = stats.finish_reason
        message.content = text
        message.stats = stats
        failed = MessageState.INTERRUPTED if interrupted else MessageState.ERROR
        message.state = {
            str(FinishReason.CANCELLED): MessageState.CANCELLED,
            str(FinishReason.ERROR): failed,
        }.get(reason, MessageState.COMPLETE)
        message.ended_with_stop = (
            reason == str(FinishReason.STOP)
            and bool(generated_ids)
            and generated_ids[-1] in self._stop_ids
        )
        session.ids.extend(generated_ids)
        session.updated = time.time()
        rt.request_id, rt.message, rt.generated = None, None, []
        rt.state = IDLE
        rt.last_stats = stats
        rt.unread = self._focused != session.id
        self._persist(session, [message])
        self._idle.notify_all()
        return ReplyFinished(session.id, message.id, rt.turn, text, stats)

    def _start_next_queued(self, session_id: str) -> list[ChatEvent]:
        """The session's reply ended (lock held): size its next queued say on a planner
        thread (`_plan_queued`), or submit its pending draft."""
        rt = self._runtime[session_id]
        events: list[ChatEvent] = []
        if rt.queue and rt.state == IDLE and not rt.planning:
            rt.planning = True
            threading.Thread(
                target=self._plan_queued,
                args=(session_id, rt.queue[0]),  # stays queued (the session busy) until started
                name="kvchat-plan",
                daemon=True,
            ).start()
        pending = rt.draft.pending
        if pending is not None and rt.state == IDLE and not rt.queue and not rt.planning:
            rt.draft.pending = None
            events.extend(self._submit_draft(self._sessions[session_id], rt, pending))
        events.append(SessionChanged(session_id))
        return events

    def _submit_draft(self, session: Session, rt: _Runtime, text: str) -> list[ChatEvent]:
        """Render `text` as the next turn would and hand it to the engine (lock held)."""
        max_tokens = session.max_tokens or self._default_max_tokens
        ids = draft_prompt(
            session,
            self._renderer,
            text,
            context_length=self._engine.context_length,
            max_tokens=max_tokens,
        )
        if ids is None:
            return self._end_draft(session.id)
        d = rt.draft
        if d.draft_id is not None and ids == d.ids:
            return []
        sid = session.id

        def on_progress(event: DraftProgress) -> None:  # engine thread: hand over only
            self._tasks.put(lambda: self._on_draft_progress(sid, event))

        try:
            draft_id = self._engine.draft(ids, on_progress, replaces=d.draft_id)
        except Exception:  # a draft is only a guess: the turn computes what it needs
            log.exception("engine draft failed")
            return self._end_draft(sid)
        d.draft_id, d.ready = draft_id, min(d.ready, common_prefix(d.ids, ids))
        d.ids = ids
        return [DraftChanged(sid, d.ready, len(ids))]

    def _end_draft(self, session_id: str) -> list[ChatEvent]:
        """Cancel the session's draft, if any, without waiting (lock held)."""
        d = self._runtime[session_id].draft
        draft_id, had = d.draft_id, d.draft_id is not None or d.pending is not None
        d.clear()
        if draft_id is not None:
            with contextlib.suppress(Exception):
                self._engine.cancel(draft_id)
        return [DraftChanged(session_id, 0, 0)] if had else []

    def _on_draft_progress(self, session_id: str, event: DraftProgress) -> None:
        """Worker thread: how much of a draft is computed now."""
        with self._lock:
            rt = self._runtime.get(session_id)
            if rt is None or rt.draft.draft_id != event.draft_id:
                return  # a draft since replaced or ended
            rt.draft.ready = event.ready_tokens
            events: list[ChatEvent] = [
                DraftChanged(session_id, event.ready_tokens, event.total_tokens)
            ]
        self._publish(events)

    def notice(self, session_id: str, text: str) -> None:
        """Tell subscribers something about a session (shown by the UI, kept in its view)."""
        with self._lock:
            self._runtime[self._get(session_id).id].notice = text
        self._publish([SessionNotice(session_id, text)])


def _planning_copy(session: Session) -> Session:
    """A copy of `session` to plan a turn on outside the lock (messages and ids copied)."""
    return replace(
        session, messages=[replace(m) for m in session.messages], ids=array("I", session.ids)
    )


def _message(role: str, content: str, state: MessageState = MessageState.COMPLETE) -> Message:
    return Message(
        id=uuid.uuid4().hex, role=role, content=content, state=state, created=time.time()
    )
