"""`Turns`: a turn's one path, from `say` to the reply stored.

Every turn (a say, an edit-and-resend, a regenerate) is submitted: a turn
submitted while its session replies waits in the session's queue; otherwise it
goes to the planner (`turn_planner.py`), which sizes its prompt on a copy of the
session outside the lock (`plan_prompt`: the stored ids plus the continuation the
chat template adds; old turns dropped when the context overflows), then starts it
under the lock: the user message and the empty reply are appended and queued for
the store in one transaction, and the `Turn` goes to the engine's port. The
planner does this on its own thread while the caller returns, or, for a say when
it is idle and the renderer only computes, on the caller's thread. Why the turn is
not handed on to the service's worker to start: each thread a turn waits for on
its way to the engine is one more wake-up before its prefill
(docs/notes/2026-12-05-turn-hand-off-latency.md). What the start announces is
still published on the worker, in a task queued before the engine hears of the
turn, so it follows the previous reply's `ReplyFinished` and precedes the reply's
own events. The engine's events come back on the engine thread, are only queued
there, and are applied on the worker: the reply grows, is saved every few tokens,
and when it ends it is stored before `ReplyFinished` is published, then the
session's next queued turn is sized.

A turn that cannot start (its prompt does not fit, the renderer failed) publishes
`SessionFailed` and changes nothing; the turns behind it go on.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvchat.chat.engine_port import Turn, TurnFinished
from kvchat.chat.events import (
    ChatEvent,
    ReplyDelta,
    ReplyFinished,
    ReplyStarted,
    SessionFailed,
    SessionRenamed,
)
from kvchat.chat.live_sessions import LiveSessions
from kvchat.chat.persistence import Persistence
from kvchat.chat.prompt_plan import PromptPlan, cut_ids, plan_prompt, reset_offsets
from kvchat.chat.service_worker import ServiceWorker
from kvchat.chat.session import (
    Message,
    MessageState,
    Session,
    TurnState,
    TurnStats,
    new_message,
)
from kvchat.chat.session_runtime import PendingTurn, SessionRuntime
from kvchat.chat.turn_planner import Job, TurnPlanner
from kvchat.chat.type_ahead import TypeAhead
from kvchat.engine.api import (
    EngineEvent,
    FinishReason,
    PrefillProgress,
    RequestFinished,
    RequestStarted,
    SamplingParams,
    TokenGenerated,
)
from kvchat.errors import KvchatError

log = logging.getLogger("kvchat.chat")

# what a reply's finish reason leaves its message as (an error is an interrupted
# message when the backend's stream broke after text arrived)
_FINISHED_STATE: dict[str, MessageState] = {
    FinishReason.CANCELLED: MessageState.CANCELLED,
    FinishReason.ERROR: MessageState.ERROR,
}


@dataclass(frozen=True)
class _Planned:
    """A sized turn: its user message and prompt plan."""

    user: Message
    plan: PromptPlan


@dataclass(frozen=True)
class _Regenerated:
    """A sized regenerate: the prompt ids once the last reply is cut (None: the stored ids
    cut where the reply began)."""

    rendered: tuple[int, ...] | None


@dataclass(frozen=True)
class _Refused:
    """A turn that cannot start, and why."""

    message: str
    unexpected: str | None = None  # not a KvchatError: the failure's own text


class Turns:
    """Submits, sizes, starts, streams and finishes the sessions' turns."""

    def __init__(
        self,
        live: LiveSessions,
        persistence: Persistence,
        worker: ServiceWorker,
        planner: TurnPlanner,
        type_ahead: TypeAhead,
        *,
        save_interval_s: float,
        save_every_tokens: int,
    ) -> None:
        self._live = live
        self._persistence = persistence
        self._worker = worker
        self._planner = planner
        self._type_ahead = type_ahead
        self._save_interval_s = save_interval_s
        self._save_every_tokens = save_every_tokens
        self._submitted = 0  # turns submitted so far: each one's number

    # --------------------------------------------------------------- commands

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
        """Submit a user message; its reply starts once it is sized and the session's
        reply before it ended. Returns the turn's number (`SessionFailed.turn`)."""
        live = self._live
        with live.lock:
            live.get(session_id).unsent = ""  # stored with the message
            number, events, job = self.submit_locked(
                session_id,
                text,
                sampling=sampling,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                title=title,
                on_caller=True,
            )
        if job is not None:
            self._planner.run_here(job)  # sized and started here, outside the lock
        live.publish(events)
        return number

    def submit_locked(
        self,
        session_id: str,
        text: str,
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int | None = None,
        ignore_eos: bool = False,
        title: str | None = None,
        cut_at: int | None = None,
        on_caller: bool = False,
    ) -> tuple[int, list[ChatEvent], Job | None]:
        """Queue a turn, or hand it to the planner when the session is idle (lock held).
        Returns its number, the events to publish and, when the caller is to size and
        start it itself once it releases the lock (`on_caller`, see `_plan_locked`), the
        planner's job."""
        rt = self._live.runtime[session_id]
        self._submitted += 1
        turn = PendingTurn(
            self._submitted,
            text,
            sampling,
            max_tokens,
            ignore_eos,
            title=title,
            cut_at=cut_at,
            waited=rt.busy,
        )
        if turn.waited:
            rt.queue.append(turn)
            rt.type_ahead.pending = None  # the text it held is sent now
            return turn.number, [self._live.changed(session_id)], None
        return turn.number, [], self._plan_locked(session_id, rt, turn, on_caller=on_caller)

    def stop(self, session_id: str) -> None:
        """Cancel the running reply (queued turns then start, in order). A turn still being
        sized is the reply about to run: it is cancelled as it starts."""
        live = self._live
        with live.lock:
            rt = live.runtime[live.get(session_id).id]
            request_id = rt.request_id
            if request_id is None and rt.planning is not None:
                rt.stop_at_start = True
        if request_id is not None:
            live.backend.engine.cancel(request_id)

    def regenerate(self, session_id: str) -> int:
        """Replace the last reply: the same prompt ids again (a full cache hit). Raises
        `KvchatError` at once when there is no reply to replace or a reply runs."""
        live = self._live
        with live.lock:
            session = live.get(session_id)
            live.require_idle(session_id, "regenerate")
            k = len(session.messages) - 1
            if k < 0 or session.messages[k].role != "assistant":
                raise KvchatError("there is no reply to regenerate")
            if session.messages[k - 1].role != "user":
                raise KvchatError("the last reply does not follow a user message")
            self._submitted += 1
            turn = PendingTurn(self._submitted, "", cut_at=k, regenerate=True)
            self._plan_locked(session_id, live.runtime[session_id], turn)
        return turn.number

    # ------------------------------------------------------------ sizing a turn

    def _plan_locked(
        self, session_id: str, rt: SessionRuntime, turn: PendingTurn, *, on_caller: bool = False
    ) -> Job | None:
        """Mark `turn` as being sized and hand it to the planner (lock held). The session
        is busy meanwhile, so nothing else changes its messages or ids.

        `on_caller`: a plain say may be sized and started on the caller's thread when the
        renderer only computes and the session's ids are not stale (a full render of a
        long history stays off the caller's thread); the planner hands the job back, for
        the caller to run once it released the lock, when nothing is queued before it."""
        rt.planning = turn
        session = self._live.sessions[session_id]
        copy = _planning_copy(session)
        renderer = self._live.backend.renderer
        here = (
            on_caller
            and getattr(renderer, "renders_locally", False)
            and turn.cut_at is None
            and not turn.regenerate
            and not session.ids_stale
        )
        return self._planner.plan(lambda: self._plan(session_id, turn, copy), on_caller=here)

    def _plan(self, session_id: str, turn: PendingTurn, copy: Session) -> None:
        """The planner's job (on its thread, or the caller's): size `turn` on `copy`, then
        start it."""
        planned: _Planned | _Regenerated | _Refused
        try:
            planned = self._size_regenerate(copy) if turn.regenerate else self._size(turn, copy)
        except KvchatError as exc:
            planned = _Refused(str(exc))
        except Exception as exc:  # a renderer's failure: this turn fails, the next ones go on
            log.exception("sizing a turn failed")
            planned = _Refused(f"could not start the turn: {exc}", unexpected=str(exc))
        self._start_sized(session_id, turn, planned)

    def _size(self, turn: PendingTurn, copy: Session) -> _Planned:
        backend = self._live.backend
        if turn.cut_at is not None:
            _cut(copy, turn.cut_at)
        max_tokens = turn.max_tokens or copy.max_tokens or backend.default_max_tokens
        user = new_message("user", turn.text)
        plan = plan_prompt(copy, user, max_tokens, backend.renderer, backend.engine.context_length)
        return _Planned(user, plan)

    def _size_regenerate(self, copy: Session) -> _Regenerated:
        """The stored ids cut where the last reply began; rendered again when they cannot
        be cut there (offsets unknown)."""
        k = len(copy.messages) - 1
        if cut_ids(copy, k):
            return _Regenerated(None)
        del copy.messages[k:]
        renderer = self._live.backend.renderer
        return _Regenerated(
            tuple(renderer.prompt_ids([m.as_chat() for m in copy.context_messages()]))
        )

    def _start_sized(
        self, session_id: str, turn: PendingTurn, planned: _Planned | _Regenerated | _Refused
    ) -> None:
        """The planner's job: start the turn `planned` sized, or report why it cannot start.

        Its events are published on the worker by a task queued before the engine can
        send the reply's first event (`_announce`), so its `ReplyStarted` follows the
        previous reply's `ReplyFinished` and precedes its own reply's events.
        """
        live = self._live
        events: list[ChatEvent] = []
        with live.lock:
            self._worker.put(lambda: self._announce(session_id, events))  # filled below
            live.announcement_begins(session_id)
            rt = live.runtime[session_id]
            session = live.sessions[session_id]
            if rt.planning is not turn:
                return  # the service is closing: the turn was dropped
            rt.planning = None
            stop, rt.stop_at_start = rt.stop_at_start, False
            if session.deleted_at is not None:
                pass  # deleted while it was sized: never started
            elif isinstance(planned, _Refused):
                events.append(
                    SessionFailed(
                        session_id,
                        planned.message,
                        live.snapshot(session_id),
                        turn=turn.number,
                        text=turn.text,
                        edit=turn.cut_at is not None and not turn.regenerate,
                        waited=turn.waited,
                        unexpected=planned.unexpected,
                    )
                )
            elif isinstance(planned, _Regenerated):
                events += self._start_regenerated(session, turn, planned)
            else:
                events += self._start_planned(session, turn, planned)
            started = rt.request_id
            events += self._next_locked(session_id)
            live.idle.notify_all()
        if stop and started is not None:
            live.backend.engine.cancel(started)

    def _announce(self, session_id: str, events: list[ChatEvent]) -> None:
        """Worker thread: publish what a turn's start produced. The planner fills `events`
        under the lock it held when it queued this task, so taking the lock here waits
        for the start to be complete."""
        live = self._live
        try:
            with live.lock:
                events = list(events)
            live.publish(events)
        finally:
            live.announcement_ends(session_id)

    def _start_planned(
        self, session: Session, turn: PendingTurn, planned: _Planned
    ) -> list[ChatEvent]:
        """Cut (an edit), append the user message, apply its plan, start the reply (lock
        held)."""
        removed = _cut(session, turn.cut_at) if turn.cut_at is not None else []
        user, plan = planned.user, planned.plan
        type_ahead_events = self._type_ahead.end_locked(session.id)
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
        if turn.title is not None:
            session.title = turn.title
        events = type_ahead_events + self._start_reply(session, turn, also=changed, removed=removed)
        if turn.title is not None:
            events.append(SessionRenamed(session.id, turn.title, self._live.snapshot(session.id)))
        return events

    def _start_regenerated(
        self, session: Session, turn: PendingTurn, planned: _Regenerated
    ) -> list[ChatEvent]:
        """Cut the last reply and start its replacement (lock held)."""
        assert turn.cut_at is not None  # a regenerate cuts where the last reply began
        cut_ids(session, turn.cut_at)
        removed = [m.id for m in session.messages[turn.cut_at :]]
        del session.messages[turn.cut_at :]
        if planned.rendered is not None:
            session.ids = array("I", planned.rendered)
            session.ids_stale = False
            reset_offsets(session.context_messages())
        session.updated = time.time()
        return self._start_reply(session, turn, also=list(session.messages), removed=removed)

    # --------------------------------------------------------------- a reply

    def _start_reply(
        self,
        session: Session,
        turn: PendingTurn,
        also: Iterable[Message] = (),
        removed: Iterable[str] = (),
    ) -> list[ChatEvent]:
        """Submit session.ids as the prompt; the assistant message streams into the store
        (lock held).

        `also` (the user message) is saved in the same transaction as the reply's
        message, so another process's turn never lands between them.
        """
        live = self._live
        backend = live.backend
        rt = live.runtime[session.id]
        messages = tuple(m.as_chat() for m in session.context_messages())
        assistant = new_message("assistant", "", state=MessageState.STREAMING)
        assistant.offset = len(session.ids)
        session.messages.append(assistant)
        session.model_fingerprint = backend.engine.model_fingerprint
        if backend.model_name:
            session.model_name = backend.model_name
        rt.message, rt.generated, rt.unsaved_tokens = assistant, [], 0
        rt.turn = session.turn_count()
        rt.state = TurnState.QUEUED
        rt.last_save = time.monotonic()
        rt.notice = None
        self._persistence.persist(session, [*also, assistant], removed=removed)
        events: list[ChatEvent] = [
            ReplyStarted(session.id, assistant.id, rt.turn, live.snapshot(session.id))
        ]
        request = Turn(
            session_id=session.id,
            messages=messages,
            prompt_ids=tuple(session.ids),
            sampling=turn.sampling or session.sampling,
            max_tokens=turn.max_tokens or session.max_tokens or backend.default_max_tokens,
            stop_token_ids=backend.stop_ids,
            ignore_eos=turn.ignore_eos,
        )
        sid, mid = session.id, assistant.id

        def on_event(event: EngineEvent) -> None:  # engine thread: hand over only
            self._worker.put(lambda: self._on_engine_event(sid, mid, event))

        try:
            rt.request_id = backend.engine.submit_turn(request, on_event)
        except Exception as exc:  # the engine refused or failed: this reply is an error
            log.exception("engine submit failed")
            events.append(self._finish(session, rt, TurnStats.failed(str(exc)), (), ""))
        return events

    def _on_engine_event(self, session_id: str, message_id: str, event: EngineEvent) -> None:
        """Worker thread: apply one engine event to its session."""
        live = self._live
        events: list[ChatEvent] = []
        with live.lock:
            session = live.sessions.get(session_id)
            rt = live.runtime.get(session_id)
            if session is None or rt is None or rt.message is None or rt.message.id != message_id:
                return  # a reply we no longer track
            if isinstance(event, RequestStarted | PrefillProgress):
                if rt.state != TurnState.PREFILLING:
                    rt.state = TurnState.PREFILLING
                    events.append(live.changed(session_id))
            elif isinstance(event, TokenGenerated):
                if rt.state != TurnState.DECODING:
                    rt.state = TurnState.DECODING
                    events.append(live.changed(session_id))
                rt.message.content += event.text
                rt.generated.extend(event.token_ids)
                rt.unsaved_tokens += len(event.token_ids)
                now = time.monotonic()
                if (
                    rt.unsaved_tokens >= self._save_every_tokens
                    or now - rt.last_save >= self._save_interval_s
                ):
                    self._persistence.persist(session, [rt.message], extra_ids=rt.generated)
                    rt.unsaved_tokens, rt.last_save = 0, now
                events.append(ReplyDelta(session_id, message_id, event.text, event.token_ids))
            elif isinstance(event, RequestFinished):
                text = event.text or rt.message.content
                cut = isinstance(event, TurnFinished) and event.interrupted
                stats = TurnStats.from_finished(event)
                events.append(
                    self._finish(session, rt, stats, event.generated_ids, text, interrupted=cut)
                )
                events.extend(self._next_locked(session_id))
                live.announcement_begins(session_id)
        try:
            if any(isinstance(e, ReplyFinished) for e in events):
                # stored before anyone is told: a reply printed or shown as finished
                # survives a kill -9 the moment after
                self._persistence.drain()
            live.publish(events)
        finally:
            if isinstance(event, RequestFinished):
                live.announcement_ends(session_id)

    def _finish(
        self,
        session: Session,
        rt: SessionRuntime,
        stats: TurnStats,
        generated_ids: tuple[int, ...],
        text: str,
        *,
        interrupted: bool = False,
    ) -> ReplyFinished:
        """End the live reply (lock held). `interrupted`: the backend's stream broke after
        text arrived; the partial reply is kept as an interrupted message."""
        live = self._live
        message = rt.message
        assert message is not None  # only called with a live reply
        reason = stats.finish_reason
        message.content = text
        message.stats = stats
        state = _FINISHED_STATE.get(reason, MessageState.COMPLETE)
        if state == MessageState.ERROR and interrupted:
            state = MessageState.INTERRUPTED
        message.state = state
        message.ended_with_stop = (
            reason == FinishReason.STOP
            and bool(generated_ids)
            and generated_ids[-1] in live.backend.stop_ids
        )
        session.ids.extend(generated_ids)
        session.updated = time.time()
        rt.request_id, rt.message, rt.generated = None, None, []
        rt.state = TurnState.IDLE
        rt.last_stats = stats
        rt.unread = live.focused != session.id
        self._persistence.persist(session, [message])
        live.idle.notify_all()
        return ReplyFinished(
            session.id, message.id, rt.turn, text, stats, live.snapshot(session.id)
        )

    def _next_locked(self, session_id: str) -> list[ChatEvent]:
        """The session's reply ended, or a turn could not start (lock held): size its next
        queued turn, or submit the type-ahead typed meanwhile."""
        rt = self._live.runtime[session_id]
        if rt.queue and rt.state == TurnState.IDLE and rt.planning is None:
            self._plan_locked(session_id, rt, rt.queue.popleft())
        events = self._type_ahead.submit_pending_locked(session_id)
        events.append(self._live.changed(session_id))
        return events


def _cut(session: Session, k: int) -> list[str]:
    """Cut `session` at message k (an edit); returns the ids of the messages removed."""
    cut_ids(session, k)
    removed = [m.id for m in session.messages[k:]]
    del session.messages[k:]
    return removed


def _planning_copy(session: Session) -> Session:
    """A copy of `session` to size a turn on outside the lock (messages and ids copied)."""
    return replace(
        session, messages=[replace(m) for m in session.messages], ids=array("I", session.ids)
    )
