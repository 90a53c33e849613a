"""A database that refuses writes: reported at once, retried, and nothing lost at exit.

The fault is SQLite's own: `PRAGMA query_only` (every write fails with "attempt to
write a readonly database") or `PRAGMA max_page_count` (a full database) on the
store's real connection, so the store's and the service's real code paths meet it.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from kvchat.chat import service_worker as service_module
from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.events import ChatEvent, ReplyFinished, SaveFailed, SaveRecovered
from kvchat.chat.recovery import write_recovery
from kvchat.chat.service import SessionService
from kvchat.chat.store import MessageRecord, SessionRecord, Store
from kvchat.chat.write_behind import WriteBehind
from kvchat.headless import run_script
from kvchat.paths import app_paths
from kvchat.testing.fake_engine import CharRenderer, FakeEngine
from kvchat.testing.tui import fake_app, ready, wait_until
from tests.tui_helpers import transcript_texts


def set_pragma(store: Store, pragma: str) -> None:
    """Turn a fault on or off on the store's own connection (between its transactions)."""
    with store._lock:
        store._db.execute(f"PRAGMA {pragma}")


def stored(path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Session title -> (role, state, content) of each stored message, read afresh."""
    store = Store(path)
    try:
        return {
            record.title: [(m.role, m.state, m.content) for m in messages]
            for record, messages in store.load()
        }
    finally:
        store.close()


class Events:
    def __init__(self) -> None:
        self.seen: list[ChatEvent] = []
        self.cond = threading.Condition()

    def __call__(self, event: ChatEvent) -> None:
        with self.cond:
            self.seen.append(event)
            self.cond.notify_all()

    def wait_for(self, kind: type, timeout: float = 10.0) -> ChatEvent:
        with self.cond:
            assert self.cond.wait_for(
                lambda: any(isinstance(e, kind) for e in self.seen), timeout
            ), f"no {kind.__name__} event"
            return next(e for e in self.seen if isinstance(e, kind))


@pytest.fixture
def fast_retry(monkeypatch) -> None:
    monkeypatch.setattr(service_module, "RETRY_SAVE_S", 0.05)


def make_service(path: Path) -> tuple[SessionService, FakeEngine, Store, Events]:
    engine, renderer = FakeEngine(), CharRenderer()
    store = Store(path)
    service = SessionService(engine, renderer, store, stop_token_ids=renderer.stop_token_ids)
    events = Events()
    service.subscribe(events)
    return service, engine, store, events


def test_a_refused_write_is_reported_and_stored_once_the_database_takes_writes(
    tmp_path, fast_retry
) -> None:
    db = tmp_path / "data" / "sessions.sqlite3"
    service, engine, store, events = make_service(db)
    try:
        sid = service.create_session("chat")
        service.say(sid, "first")
        assert service.wait_idle(sid, 10) and service.flush(10)
        set_pragma(store, "query_only = 1")
        service.say(sid, "second")
        assert service.wait_idle(sid, 10)
        failed = events.wait_for(SaveFailed)
        assert "readonly" in failed.error and failed.unsaved_messages >= 2
        assert service.save_error is not None and service.unsaved_messages() >= 2
        assert [m[2] for m in stored(db)["chat"] if m[0] == "user"] == ["first"]  # not yet

        set_pragma(store, "query_only = 0")
        events.wait_for(SaveRecovered)  # the retry, with nothing else written meanwhile
        assert service.save_error is None and service.unsaved_messages() == 0
    finally:
        report = service.close()
        engine.close()
    assert report is None  # nothing left for a recovery file
    messages = stored(db)["chat"]
    assert [(m[0], m[1]) for m in messages] == [("user", "complete"), ("assistant", "complete")] * 2
    assert messages[2][2] == "second" and messages[3][2] == service.messages(sid)[3].content


def test_what_cannot_be_stored_is_written_to_a_recovery_file_at_close(tmp_path) -> None:
    db = tmp_path / "data" / "sessions.sqlite3"
    service, engine, store, events = make_service(db)
    try:
        sid = service.create_session("chat")
        service.say(sid, "kept")
        assert service.wait_idle(sid, 10) and service.flush(10)
        set_pragma(store, "query_only = 1")
        service.say(sid, "never stored")
        assert service.wait_idle(sid, 10)
        reply = service.messages(sid)[-1].content
        events.wait_for(SaveFailed)
    finally:
        report = service.close()
        engine.close()
    assert report is not None and report.path is not None
    assert report.path.parent == db.parent and report.messages == 2
    assert str(report.path) in report.summary()
    saved = json.loads(report.path.read_text())
    ((session,),) = [saved["sessions"]]
    assert session["title"] == "chat"
    assert [(m["role"], m["content"], m["state"]) for m in session["messages"]] == [
        ("user", "never stored", "complete"),
        ("assistant", reply, "complete"),
    ]
    assert "readonly" in saved["error"]
    assert [m[2] for m in stored(db)["chat"]] == ["kept", service.messages(sid)[1].content]


def test_a_full_database_is_a_failed_save_too(tmp_path) -> None:
    db = tmp_path / "sessions.sqlite3"
    service, engine, store, events = make_service(db)
    try:
        sid = service.create_session("chat")
        assert service.flush(10)
        with store._lock:
            pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        set_pragma(store, f"max_page_count = {pages}")
        service.say(sid, "a long message " * 200)  # needs new pages
        assert service.wait_idle(sid, 10)
        assert "full" in events.wait_for(SaveFailed).error
    finally:
        report = service.close()
        engine.close()
    assert report is not None and report.messages == 2


def test_the_recovery_file_falls_back_to_the_temporary_folder(tmp_path) -> None:
    writes = WriteBehind(Store.in_memory())
    session = SessionRecord("s", "title", 0.0, 0.0, False, None, "m", b"", False, None, None)
    message = MessageRecord("m1", 0, "user", "hello", "complete", None, 0, False, True, None, 0.0)
    writes.add(session, [message])
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    report = write_recovery(writes.pending(), "db", "disk I/O error", [not_a_folder / "data"])
    assert report is not None and report.path is not None
    try:
        assert report.path.parent != not_a_folder / "data"
        assert json.loads(report.path.read_text())["sessions"][0]["messages"][0]["content"] == (
            "hello"
        )
    finally:
        report.path.unlink()


class ReadOnlyAfterFirstReply(Store):
    """The real store; the database turns read-only once the first reply is stored."""

    def save(self, session, messages=(), **kw):
        result = super().save(session, messages, **kw)
        if any(m.role == "assistant" and m.state == "complete" for m in messages):
            set_pragma(self, "query_only = 1")
        return result


def test_headless_save_reports_a_failed_write_and_exits_1_with_the_recovery_file(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("kvchat.headless.Store", ReadOnlyAfterFirstReply)
    script = tmp_path / "script.jsonl"
    lines = [
        {"op": "new", "session": "a"},
        {"op": "say", "session": "a", "text": "one"},
        {"op": "wait"},
        {"op": "say", "session": "a", "text": "two"},
    ]
    script.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    engine, renderer = FakeEngine(), CharRenderer()
    out = io.StringIO()
    try:
        code = run_script(
            str(script),
            stream=False,
            save=True,
            services=lambda: ChatBackend(engine, renderer, renderer.stop_token_ids),
            stdout=out,
            stderr=io.StringIO(),
        )
    finally:
        engine.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert code == 1
    replies = [e for e in events if e["event"] == "reply"]
    assert len(replies) == 2
    errors = [e for e in events if e["event"] == "error"]
    assert "could not save" in errors[0]["message"] and "readonly" in errors[0]["message"]
    recovery = Path(errors[-1]["recovery_file"])
    assert recovery.parent == app_paths().data_dir
    assert str(recovery) in errors[-1]["message"]
    saved = json.loads(recovery.read_text())["sessions"][0]["messages"]
    assert [m["content"] for m in saved] == ["two", replies[1]["text"]]


async def test_the_tui_shows_a_banner_until_saving_works_and_quits_1_with_the_file(
    tmp_path, fast_retry
) -> None:
    db = tmp_path / "data" / "sessions.sqlite3"
    store = Store(db)
    app, _ = fake_app(store=store)
    async with app.run_test(size=(150, 45)) as pilot:
        await ready(pilot, app)
        await pilot.press(*"hello", "enter")
        await wait_until(pilot, lambda: len(transcript_texts(app)) == 2, what="first reply")
        await wait_until(pilot, lambda: app.service.session(app.chat.current).state == "idle")
        assert app.service.flush(10)
        assert not app.chat.save_banner.display

        set_pragma(store, "query_only = 1")
        await pilot.press(*"again", "enter")
        await wait_until(pilot, lambda: app.chat.save_banner.display, what="the banner")
        shown = str(app.chat.save_banner.render())
        assert "NOT SAVED" in shown and "readonly" in shown and "recovery file" in shown

        set_pragma(store, "query_only = 0")
        await wait_until(pilot, lambda: not app.chat.save_banner.display, what="the banner to go")
        assert any("Saving works again" in n.message for n in app._notifications)

        set_pragma(store, "query_only = 1")
        await pilot.press(*"lost?", "enter")
        await wait_until(pilot, lambda: app.chat.save_banner.display, what="the banner again")
        await wait_until(pilot, lambda: app.service.session(app.chat.current).state == "idle")
        await pilot.press("ctrl+q")
    app.shutdown()
    assert app.exit_code == 1 and app.unsaved is not None
    assert app.unsaved.path is not None and app.unsaved.path.parent == db.parent
    saved = json.loads(app.unsaved.path.read_text())["sessions"][0]["messages"]
    assert saved[0]["content"] == "lost?" and saved[1]["role"] == "assistant"
    assert [m[2] for m in stored(db)["hello"] if m[0] == "user"] == ["hello", "again"]


def test_a_reply_is_stored_whole_before_it_is_announced(tmp_path) -> None:
    """What a subscriber is told finished (a printed `reply`, a turn shown done) is
    already in the database: a kill -9 the moment after cannot lose it."""
    db = tmp_path / "sessions.sqlite3"
    service, engine, _, _ = make_service(db)
    seen_in_db: list[list[tuple[str, str, str]]] = []

    def on_event(event: ChatEvent) -> None:
        if isinstance(event, ReplyFinished):
            seen_in_db.append(stored(db)["chat"])

    service.subscribe(on_event)
    try:
        sid = service.create_session("chat")
        for text in ("one", "two"):
            service.say(sid, text)
            assert service.wait_idle(sid, 10)  # returns once ReplyFinished was published
    finally:
        service.close()
        engine.close()
    shown = [(m.role, "complete", m.content) for m in service.messages(sid)]
    assert seen_in_db == [shown[:2], shown]
