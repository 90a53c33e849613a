"""How a turn starts and ends in SessionService, for a backend that may be slow or cut off.

A turn's prompt is sized outside the service's lock (for a server the renderer
asks its /tokenize): the service keeps answering, and says sent meanwhile queue
in order. A reply whose stream breaks after text arrived is kept, stored as
`interrupted`, and the conversation goes on from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import pytest

from kvchat.chat.engine_port import Turn, TurnFinished
from kvchat.chat.events import ReplyFinished, SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.session import MessageState
from kvchat.chat.store import Store
from kvchat.engine.api import (
    CachedTokens,
    EngineEvent,
    EngineStats,
    FinishReason,
    RequestStarted,
    Residency,
    TokenGenerated,
)
from kvchat.testing.fake_engine import CharRenderer, FakeEngine

CUT = "the server at http://127.0.0.1:1 closed the stream mid-reply"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


class SlowRenderer(CharRenderer):
    """Renders every turn whole, as for a server, and waits in it until released."""

    def __init__(self) -> None:
        super().__init__(rewrites_history=True)
        self.entered = threading.Event()
        self.release = threading.Event()

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.entered.set()
        assert self.release.wait(30), "the test never released the renderer"
        return super().prompt_ids(messages)


def answers_within(call: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether `call` returns within `timeout` (run on a thread of its own)."""
    done = threading.Event()
    threading.Thread(target=lambda: (call(), done.set()), daemon=True).start()
    return done.wait(timeout)


def test_a_prompt_is_sized_outside_the_lock_and_says_meanwhile_keep_their_order() -> None:
    renderer = SlowRenderer()
    engine = FakeEngine(tokens_per_reply=4)
    service = SessionService(engine, renderer, Store.in_memory())
    try:
        a, b = service.create_session("a"), service.create_session("b")
        sender = threading.Thread(target=service.say, args=(a, "first"), daemon=True)
        sender.start()
        assert renderer.entered.wait(10)
        # the renderer is waiting (a slow server): the service still answers
        assert answers_within(service.list_sessions), "sizing held the service's lock"
        assert answers_within(lambda: service.rename(b, "still works"))
        service.say(a, "second")  # the session is busy: queued behind the first
        assert service.session(a).queued_says == 1
        assert engine.submitted == []
        renderer.release.set()
        sender.join(10)
        assert service.wait_idle(a, timeout=10)
        users = [m.content for m in service.messages(a) if m.role == "user"]
        assert users == ["first", "second"]
        assert len(engine.submitted) == 2
        assert service.session(b).title == "still works"
    finally:
        renderer.release.set()
        service.close()
        engine.close()


class GatedRenderer(CharRenderer):
    """Renders locally, and waits in `prompt_ids` for a message holding "wait" until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if "wait" in messages[-1]["content"]:
            self.entered.set()
            assert self.release.wait(30), "the test never released the renderer"
        return super().prompt_ids(messages)


def test_a_say_to_an_idle_planner_reaches_the_engine_before_say_returns() -> None:
    engine = FakeEngine(manual=True, tokens_per_reply=4)
    service = SessionService(engine, CharRenderer(), Store.in_memory())
    try:
        sid = service.create_session("a")
        service.say(sid, "hello")
        assert len(engine.submitted) == 1  # no flush: sized and started on this thread
        engine.advance(10)
        assert service.wait_idle(sid, timeout=10)
        service.say(sid, "again")  # a follow-up continues the stored ids here too
        assert len(engine.submitted) == 2
    finally:
        service.close()
        engine.close()


def test_a_say_behind_another_sessions_turn_being_sized_starts_after_it() -> None:
    renderer = GatedRenderer()
    engine = FakeEngine(manual=True, tokens_per_reply=4)
    service = SessionService(engine, renderer, Store.in_memory())
    try:
        a, b = service.create_session("a"), service.create_session("b")
        sender = threading.Thread(target=service.say, args=(a, "wait for me"), daemon=True)
        sender.start()
        assert renderer.entered.wait(10)  # a's turn is being sized on its caller's thread
        assert answers_within(lambda: service.say(b, "second")), "say waited for a's sizing"
        assert engine.submitted == []  # b's turn waits for a's, though b's planner is free
        renderer.release.set()
        sender.join(10)
        assert service.wait_started(10)
        prompts = ["".join(map(chr, r.prompt_ids)) for r in engine.submitted]
        assert [("wait for me" in p, "second" in p) for p in prompts] == [
            (True, False),
            (False, True),
        ]
    finally:
        renderer.release.set()
        service.close()
        engine.close()


def test_a_queued_say_that_cannot_fit_fails_alone_and_the_next_one_starts() -> None:
    engine = FakeEngine(manual=True, tokens_per_reply=4, context_length=200)
    service = SessionService(engine, CharRenderer(), Store.in_memory())
    failed: list[SessionFailed] = []
    service.subscribe(lambda e: failed.append(e) if isinstance(e, SessionFailed) else None)
    try:
        sid = service.create_session("a")
        service.say(sid, "one")
        service.say(sid, "x" * 300)  # queued; sized when its turn comes: too long
        service.say(sid, "three")
        while len(engine.submitted) < 2:
            engine.advance(1)
            service.flush(5)
        engine.advance(10)
        assert service.wait_idle(sid, timeout=10)
        assert len(failed) == 1 and "does not fit" in failed[0].message
        assert [m.content for m in service.messages(sid) if m.role == "user"] == ["one", "three"]
    finally:
        service.close()
        engine.close()


class CutStreamPort:
    """A `TurnPort` answering as a server whose stream breaks after two deltas on the first
    turn, and replies whole after that."""

    streams_token_ids = False
    model_fingerprint = "remote:test:model"
    context_length = 4096

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    def submit_turn(self, turn: Turn, on_event: Callable[[EngineEvent], None]) -> int:
        self.turns.append(turn)
        request_id = len(self.turns)
        cut = request_id == 1

        def run() -> None:
            now = time.monotonic()
            on_event(RequestStarted(request_id, now))
            pieces = ["Par", "tial"] if cut else ["Whole ", "reply."]
            for piece in pieces:
                on_event(TokenGenerated(request_id, piece, (), now))
            on_event(
                TurnFinished(
                    request_id=request_id,
                    reason=FinishReason.ERROR if cut else FinishReason.STOP,
                    prompt_tokens=20,
                    cached_tokens=CachedTokens(0, None, None),
                    prefilled_tokens=20,
                    recomputed_tokens=None,
                    generated_ids=(),
                    text="".join(pieces),
                    ttft_s=0.01,
                    decode_tok_s=None,
                    time=now,
                    error=f"{CUT}; the partial reply is kept" if cut else None,
                    generated_count=len(pieces),
                    interrupted=cut,
                )
            )

        threading.Thread(target=run, daemon=True).start()
        return request_id

    def cancel(self, request_id: int) -> None:
        pass

    def type_ahead(self, token_ids, on_progress, *, replaces=None) -> int:
        return 0

    def prefetch(self, token_ids) -> None:
        pass

    def residency(self, token_ids) -> Residency:
        return Residency(0, 0, 0)

    def stats(self) -> EngineStats:
        raise NotImplementedError


def test_a_stream_cut_after_text_is_stored_interrupted_and_the_chat_goes_on(tmp_path) -> None:
    db = tmp_path / "s.sqlite3"
    port = CutStreamPort()
    service = SessionService(port, CharRenderer(rewrites_history=True), Store(db))
    finished: list[ReplyFinished] = []
    service.subscribe(lambda e: finished.append(e) if isinstance(e, ReplyFinished) else None)
    sid = service.create_session("a")
    service.say(sid, "Tell me.")
    assert service.wait_idle(sid, timeout=10)
    reply = service.messages(sid)[-1]
    assert reply.state == MessageState.INTERRUPTED and reply.content == "Partial"
    assert finished[0].stats.finish_reason == "error" and finished[0].text == "Partial"
    assert CUT in (finished[0].stats.error or "")
    # the next turn sends the partial reply as part of the conversation
    service.say(sid, "Go on.")
    assert service.wait_idle(sid, timeout=10)
    assert [dict(m) for m in port.turns[1].messages][-2:] == [
        {"role": "assistant", "content": "Partial"},
        {"role": "user", "content": "Go on."},
    ]
    assert service.close() is None
    store = Store(db)
    try:
        (_, rows), *_ = store.load()
        assert [r.state for r in rows] == ["complete", "interrupted", "complete", "complete"]
        assert rows[1].content == "Partial"
    finally:
        store.close()
