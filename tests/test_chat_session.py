"""SessionService on the fake engine: ids never re-rendered, edits cut at their point, overflow."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvchat.chat.events import ReplyDelta, ReplyFinished, SessionFailed
from kvchat.chat.service import MODEL_CHANGED_NOTICE, SessionService
from kvchat.chat.session import MessageState
from kvchat.chat.store import Store
from kvchat.errors import KvchatError
from kvchat.testing.fake_engine import END, CharRenderer, FakeEngine


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


def make(
    engine: FakeEngine | None = None,
    renderer: CharRenderer | None = None,
    store: Store | None = None,
) -> tuple[SessionService, FakeEngine, CharRenderer]:
    engine = engine or FakeEngine()
    renderer = renderer or CharRenderer()
    service = SessionService(
        engine, renderer, store or Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )
    return service, engine, renderer


@pytest.fixture
def chat() -> Iterator[tuple[SessionService, FakeEngine, CharRenderer]]:
    service, engine, renderer = make()
    yield service, engine, renderer
    service.close()
    engine.close()


def say_and_wait(service: SessionService, sid: str, text: str) -> None:
    service.say(sid, text)
    assert service.wait_idle(sid, timeout=10)


def chat_messages(service: SessionService, sid: str) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in service.messages(sid)]


def test_next_prompt_is_stored_ids_plus_continuation_never_a_rerender(chat) -> None:
    service, engine, renderer = chat
    sid = service.create_session("a", system="be brief")
    say_and_wait(service, sid, "hello")
    after_first = service.token_ids(sid)
    say_and_wait(service, sid, "and again")

    first, second = engine.submitted
    reply_ids = after_first[len(first.prompt_ids) :]
    assert reply_ids[-1] == END  # the stop token is part of the stored ids
    history = chat_messages(service, sid)[:3]
    continuation = renderer.continuation_ids(
        history, [{"role": "user", "content": "and again"}], reply_ended_with_stop=True
    )
    assert second.prompt_ids == first.prompt_ids + reply_ids + tuple(continuation)
    assert renderer.full_renders == 1  # only the very first prompt was rendered whole
    # and it is what a full render of the conversation would have given
    assert list(second.prompt_ids) == renderer.prompt_ids(chat_messages(service, sid)[:4])


def test_edit_last_user_message_keeps_the_ids_before_it(chat) -> None:
    service, engine, _ = chat
    sid = service.create_session("a", system="sys")
    say_and_wait(service, sid, "one")
    say_and_wait(service, sid, "two")
    before_edit = service.token_ids(sid)
    second_prompt = engine.submitted[1].prompt_ids
    prefix = service.token_ids(sid)[: len(engine.submitted[0].prompt_ids) + 9]  # turn 1 + reply

    service.edit_last_user_message(sid, "TWO, edited")
    assert service.wait_idle(sid, timeout=10)

    edited = engine.submitted[-1].prompt_ids
    assert edited[: len(prefix)] == prefix
    assert edited[: len(prefix)] == before_edit[: len(prefix)]
    assert edited != second_prompt
    assert [m.content for m in service.messages(sid)][:4] == [
        "sys",
        "one",
        prefix_reply(service, sid),
        "TWO, edited",
    ]
    assert len(service.messages(sid)) == 5


def prefix_reply(service: SessionService, sid: str) -> str:
    return service.messages(sid)[2].content


def test_regenerate_submits_the_same_prompt_again(chat) -> None:
    service, engine, _ = chat
    sid = service.create_session("a")
    say_and_wait(service, sid, "one")
    say_and_wait(service, sid, "two")
    service.regenerate(sid)
    assert service.wait_idle(sid, timeout=10)
    assert engine.submitted[-1].prompt_ids == engine.submitted[-2].prompt_ids
    assert [m.role for m in service.messages(sid)] == ["user", "assistant"] * 2
    last = service.session(sid).last_turn
    assert last is not None and last.prefilled_tokens == 1  # all cached but the last token


def test_fork_copies_the_prefix_ids_and_leaves_the_source_alone(chat) -> None:
    service, engine, _ = chat
    sid = service.create_session("a", system="sys")
    say_and_wait(service, sid, "one")
    after_turn_one = service.token_ids(sid)
    say_and_wait(service, sid, "two")
    source_ids = service.token_ids(sid)

    fork = service.fork(sid, at_message=3)  # before "two"
    assert service.token_ids(fork) == after_turn_one
    assert [m.content for m in service.messages(fork)][:2] == ["sys", "one"]
    say_and_wait(service, fork, "different")
    assert engine.submitted[-1].prompt_ids[: len(after_turn_one)] == after_turn_one
    assert service.token_ids(sid) == source_ids
    with pytest.raises(KvchatError):
        service.fork(sid, at_message=2)  # an assistant message


def test_changed_system_prompt_cuts_the_ids_and_renders_from_messages(chat) -> None:
    service, engine, renderer = chat
    sid = service.create_session("a", system="old")
    say_and_wait(service, sid, "one")
    service.set_system_prompt(sid, "new")
    assert service.session(sid).context_tokens is None  # will be computed again
    say_and_wait(service, sid, "two")
    assert renderer.full_renders == 2
    assert list(engine.submitted[-1].prompt_ids) == renderer.prompt_ids(
        chat_messages(service, sid)[:4]
    )
    assert service.session(sid).system_prompt == "new"


def test_continuation_none_falls_back_to_a_full_render() -> None:
    service, engine, renderer = make(renderer=CharRenderer(rewrites_history=True))
    try:
        sid = service.create_session("a")
        say_and_wait(service, sid, "one")
        say_and_wait(service, sid, "two")
        assert renderer.full_renders == 2
        assert list(engine.submitted[-1].prompt_ids) == renderer.prompt_ids(
            chat_messages(service, sid)[:3]
        )
    finally:
        service.close()
        engine.close()


def test_overflow_drops_the_oldest_turns_in_one_large_step() -> None:
    ctx = 600
    service, engine, renderer = make(engine=FakeEngine(context_length=ctx, tokens_per_reply=8))
    try:
        sid = service.create_session("a", system="sys")
        service.set_sampling(sid, service.session(sid).sampling, max_tokens=16)
        text = "q" * 40
        overflow_at = None
        for turn in range(30):
            before = service.token_ids(sid)
            say_and_wait(service, sid, f"{turn:02d}{text}")
            prompt = engine.submitted[-1].prompt_ids
            if prompt[: len(before)] != before:
                overflow_at = turn
                break
            assert len(prompt) + 16 <= ctx
        assert overflow_at is not None
        # one step: at least a third of the context went at once
        would_have_been = (
            len(before)
            + 1
            + len(renderer._message({"role": "user", "content": f"{overflow_at:02d}{text}"}))
            + 11
        )
        assert would_have_been - len(prompt) >= ctx // 3
        assert len(prompt) + 16 <= ctx
        # the system prompt stays first; the dropped turns stay visible but out of context
        assert prompt[: len("<system>sys")] == tuple(renderer.encode("<system>sys"))
        views = service.messages(sid)
        dropped = [m for m in views if not m.in_context]
        assert dropped and dropped[0].content == f"00{text}"
        assert all(m.in_context for m in views if m.role == "system")
        assert list(prompt) == renderer.prompt_ids(
            [{"role": m.role, "content": m.content} for m in views if m.in_context][:-1]
        )
        # the turn after the drop appends to the new ids again
        kept = service.token_ids(sid)
        say_and_wait(service, sid, "after")
        assert engine.submitted[-1].prompt_ids[: len(kept)] == kept
        fraction = service.session(sid).context_fraction
        assert fraction is not None and 0 < fraction < 1
    finally:
        service.close()
        engine.close()


def test_a_turn_that_cannot_fit_fails_with_its_text_and_changes_nothing() -> None:
    service, engine, _ = make(engine=FakeEngine(context_length=100))
    failed: list[SessionFailed] = []
    service.subscribe(lambda e: failed.append(e) if isinstance(e, SessionFailed) else None)
    try:
        sid = service.create_session("a")
        turn = service.say(sid, "x" * 200)  # submitted: it is sized on the planner's thread
        assert service.wait_idle(sid, timeout=10)
        (failure,) = failed
        assert failure.turn == turn and failure.text == "x" * 200 and not failure.waited
        assert "does not fit" in failure.message and failure.unexpected is None
        assert failure.snapshot.messages == () and failure.snapshot.view.message_count == 0
        assert service.messages(sid) == []
        assert engine.submitted == []
    finally:
        service.close()
        engine.close()


def test_say_while_replying_waits_for_the_reply_to_end() -> None:
    service, engine, _ = make(engine=FakeEngine(manual=True, tokens_per_reply=4))
    try:
        sid = service.create_session("a")
        service.say(sid, "one")
        service.say(sid, "two")
        service.flush(5)  # the first is sized and started; the second waits behind it
        assert len(engine.submitted) == 1
        assert service.session(sid).queued_says == 1
        engine.advance(5)  # 4 tokens + the stop token
        assert service.wait_idle(sid, timeout=0.0) is False
        # the second turn starts by itself once the first ended
        while len(engine.submitted) < 2:
            engine.advance(1)
            service.flush(5)
        first, second = engine.submitted
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
        engine.advance(10)
        assert service.wait_idle(sid, timeout=10)
        assert [m.content for m in service.messages(sid) if m.role == "user"] == ["one", "two"]
    finally:
        service.close()
        engine.close()


def test_stop_keeps_the_partial_reply_and_the_next_turn_closes_it() -> None:
    service, engine, _ = make(engine=FakeEngine(manual=True, tokens_per_reply=50))
    deltas = threading.Semaphore(0)
    service.subscribe(lambda e: deltas.release() if isinstance(e, ReplyDelta) else None)
    try:
        sid = service.create_session("a")
        service.say(sid, "one")
        engine.advance(3)
        for _ in range(3):
            assert deltas.acquire(timeout=5)
        service.stop(sid)
        engine.advance(1)
        assert service.wait_idle(sid, timeout=5)
        reply = service.messages(sid)[-1]
        assert reply.state == MessageState.CANCELLED and len(reply.content) == 3
        stored = service.token_ids(sid)
        engine.manual = False
        engine.advance(100)
        service.say(sid, "two")
        engine.advance(100)
        assert service.wait_idle(sid, timeout=10)
        prompt = engine.submitted[-1].prompt_ids
        assert prompt[: len(stored)] == stored
        assert prompt[len(stored)] == END  # the template closes the cut reply
    finally:
        service.close()
        engine.close()


def test_reopened_with_another_model_renders_once_and_says_so(tmp_path) -> None:
    db = tmp_path / "s.sqlite3"
    service, engine, _ = make(store=Store(db))
    sid = service.create_session("a", system="sys")
    say_and_wait(service, sid, "one")
    service.close()
    engine.close()

    other = FakeEngine(fingerprint="another-model")
    service, engine, renderer = make(engine=other, store=Store(db))
    try:
        view = service.session(sid)
        assert view.notice == MODEL_CHANGED_NOTICE
        assert view.context_tokens is None
        say_and_wait(service, sid, "two")
        assert renderer.full_renders == 1
        assert list(engine.submitted[0].prompt_ids) == CharRenderer().prompt_ids(
            chat_messages(service, sid)[:4]
        )
        assert service.session(sid).model_fingerprint == "another-model"
        stored = service.token_ids(sid)
        say_and_wait(service, sid, "three")
        assert renderer.full_renders == 1
        assert engine.submitted[-1].prompt_ids[: len(stored)] == stored
    finally:
        service.close()
        engine.close()


def test_sessions_and_ids_survive_a_restart(tmp_path) -> None:
    db = tmp_path / "s.sqlite3"
    service, engine, _ = make(store=Store(db))
    sid = service.create_session("a")
    say_and_wait(service, sid, "one")
    ids, messages = service.token_ids(sid), service.messages(sid)
    service.close()
    engine.close()
    service, engine, _ = make(store=Store(db))
    try:
        assert service.token_ids(sid) == ids
        assert service.messages(sid) == messages
        assert service.session(sid).notice is None
    finally:
        service.close()
        engine.close()


def test_delete_is_undoable_until_restart(tmp_path) -> None:
    db = tmp_path / "s.sqlite3"
    service, engine, _ = make(store=Store(db))
    keep, gone = service.create_session("keep"), service.create_session("gone")
    service.delete(keep)
    assert [v.id for v in service.list_sessions()] == [gone]
    service.undo_delete(keep)
    service.delete(gone)
    service.rename(keep, "kept")
    service.set_archived(keep)
    assert service.list_sessions() == []
    assert [v.title for v in service.list_sessions(include_archived=True)] == ["kept"]
    service.close()
    engine.close()
    service, engine, _ = make(store=Store(db))
    try:
        assert [v.id for v in service.list_sessions(include_archived=True)] == [keep]
        with pytest.raises(KvchatError):
            service.session(gone)
    finally:
        service.close()
        engine.close()


def test_views_report_state_residency_unread_and_stats(chat) -> None:
    service, engine, _ = chat
    finished: list[ReplyFinished] = []
    service.subscribe(lambda e: finished.append(e) if isinstance(e, ReplyFinished) else None)
    a, b = service.create_session("a"), service.create_session("b")
    service.focus(a)
    say_and_wait(service, a, "one")
    say_and_wait(service, b, "two")
    assert service.session(a).unread is False and service.session(b).unread is True
    service.focus(b)
    assert service.session(b).unread is False
    assert engine.prefetched[-1] == service.token_ids(b)
    residency = service.residency(a)
    assert residency.device == len(service.token_ids(a)) and residency.nowhere == 0
    view = service.session(a)
    assert view.state == "idle" and view.context_tokens == len(service.token_ids(a))
    stats = view.last_turn
    assert stats is not None
    assert stats.prompt_tokens == stats.cached_tokens.total + stats.prefilled_tokens
    assert [e.turn for e in finished] == [1, 1]
    markdown = service.export_markdown(a)
    assert markdown.startswith("# a\n") and "## User\n\none" in markdown


def test_with_the_real_turn_renderer_appending_equals_a_full_render(tmp_path) -> None:
    turn_renderer = pytest.importorskip("kvchat.model.turn_renderer")
    from kvchat.model.chat_template import ChatTemplate
    from kvchat.model.tokenizer import Tokenizer
    from tests.tiny_tokenizers import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, "chatml")
    tokenizer = Tokenizer.from_folder(tmp_path)
    template = ChatTemplate(
        tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    full_renders: list[int] = []

    class CountingRenderer(turn_renderer.TurnRenderer):
        def prompt_ids(self, messages):  # type: ignore[no-untyped-def]
            full_renders.append(len(messages))
            return super().prompt_ids(messages)

    renderer = CountingRenderer(tokenizer, template)
    stop_id = tokenizer.token_to_id("<|im_end|>")
    assert stop_id in tokenizer.stop_token_ids
    replies = iter(["It doubles x.", "No errors handled.", "Fine."])
    engine = FakeEngine(
        reply_text=lambda _request: next(replies),
        encode=lambda text: tokenizer.encode(text),
        decode=lambda ids: tokenizer.decode(list(ids)),
        stop_token_id=stop_id,
    )
    service = SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=tokenizer.stop_token_ids
    )
    try:
        sid = service.create_session("real", system="You are terse.")
        for text in ["What does f do?", "Any error handling?", "Thanks."]:
            before = service.token_ids(sid)
            say_and_wait(service, sid, text)
            prompt = engine.submitted[-1].prompt_ids
            assert prompt[: len(before)] == before
            assert full_renders == [2]  # only the first turn was rendered whole
            history = chat_messages(service, sid)[:-1]
            assert list(prompt) == renderer.prompt_ids(history)  # and still exact
            full_renders.pop()
        assert all(m.state == MessageState.COMPLETE for m in service.messages(sid))
    finally:
        service.close()
        engine.close()
