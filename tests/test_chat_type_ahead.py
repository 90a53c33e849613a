"""Session-layer type-ahead: rendered as the turn will be, replaced, ended, held while busy."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvchat.chat.events import ReplyFinished, TypeAheadChanged
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.testing.fake_engine import CharRenderer, FakeEngine


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


@pytest.fixture
def chat() -> Iterator[tuple[SessionService, FakeEngine, list]]:
    engine = FakeEngine()
    renderer = CharRenderer()
    service = SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )
    events: list = []
    service.subscribe(events.append)
    yield service, engine, events
    service.close()
    engine.close()


def wait_for(condition, service: SessionService, timeout: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        service.flush(1)
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met in time")


def test_first_turn_type_ahead_is_the_prefix_of_the_turns_prompt(chat) -> None:
    service, engine, events = chat
    sid = service.create_session("a", system="be brief")
    service.type_ahead(sid, "a long document")
    wait_for(lambda: service.type_ahead_progress(sid) == (len(engine.type_aheads[0]),) * 2, service)
    service.say(sid, "a long document, and a question")
    assert service.wait_idle(sid, timeout=10)
    (prompt,) = [r.prompt_ids for r in engine.submitted]
    (ahead,) = engine.type_aheads
    assert prompt[: len(ahead)] == ahead
    finished = [e for e in events if isinstance(e, ReplyFinished)]
    assert finished[-1].stats.draft_tokens == len(ahead)
    assert service.type_ahead_progress(sid) == (0, 0)  # the say ended the type-ahead


def test_follow_up_type_ahead_extends_the_stored_ids(chat) -> None:
    service, engine, _ = chat
    sid = service.create_session("a")
    service.say(sid, "hello")
    assert service.wait_idle(sid, timeout=10)
    stored = service.token_ids(sid)
    service.type_ahead(sid, "and then")
    wait_for(lambda: len(engine.type_aheads) == 1, service)
    service.say(sid, "and then some")
    assert service.wait_idle(sid, timeout=10)
    ahead = engine.type_aheads[0]
    assert ahead[: len(stored)] == stored
    assert engine.submitted[-1].prompt_ids[: len(ahead)] == ahead


def test_a_new_type_ahead_replaces_the_old_and_the_same_text_is_not_sent_again(chat) -> None:
    service, engine, events = chat
    sid = service.create_session("a")
    service.type_ahead(sid, "one")
    service.type_ahead(sid, "one")
    service.type_ahead(sid, "one two")
    progress = service.type_ahead_progress
    wait_for(lambda: progress(sid)[0] == progress(sid)[1] > 0, service)
    first = len(engine.type_aheads[0])
    assert [len(d) for d in engine.type_aheads] == [first, first + 4]
    assert any(
        isinstance(e, TypeAheadChanged) and e.total_tokens == len(engine.type_aheads[1])
        for e in events
    )


def test_an_empty_text_or_end_type_ahead_cancels_the_engine_type_ahead(chat) -> None:
    service, engine, events = chat
    sid = service.create_session("a")
    service.type_ahead(sid, "something")
    service.type_ahead(sid, "   ")
    assert service.type_ahead_progress(sid) == (0, 0)
    service.type_ahead(sid, "again")
    service.end_type_ahead(sid)
    assert len(engine.cancelled_ids) == 2
    assert events[-1] == TypeAheadChanged(sid, 0, 0)


def test_a_type_ahead_while_replying_waits_for_the_reply_to_end() -> None:
    engine = FakeEngine(manual=True, tokens_per_reply=3)
    renderer = CharRenderer()
    service = SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )
    try:
        sid = service.create_session("a")
        service.say(sid, "first")
        service.flush(5)  # sized and started: the session replies
        service.type_ahead(sid, "second, typed while the reply streams")
        assert engine.type_aheads == []
        while service.session(sid).state != "idle":
            engine.advance(1)
            service.flush(5)
        wait_for(lambda: len(engine.type_aheads) == 1, service)
        assert engine.type_aheads[0][: len(service.token_ids(sid))] == service.token_ids(sid)
    finally:
        service.close()
        engine.close()


def test_a_template_that_cannot_be_appended_to_gives_no_type_ahead() -> None:
    engine = FakeEngine()
    renderer = CharRenderer(rewrites_history=True)
    service = SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )
    try:
        sid = service.create_session("a")
        service.type_ahead(sid, "text")
        assert engine.type_aheads == [] and service.type_ahead_progress(sid) == (0, 0)
    finally:
        service.close()
        engine.close()
