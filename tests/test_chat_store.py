"""The SQLite store: concurrent processes, a reply cut by kill -9, schema versions."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchat.chat.service import SessionService
from kvchat.chat.session import MessageState
from kvchat.chat.store import SCHEMA_VERSION, MessageRecord, SessionRecord, Store
from kvchat.errors import KvchatError
from kvchat.testing.fake_engine import CharRenderer, FakeEngine

ROOT = Path(__file__).resolve().parents[1]


def _session(sid: str) -> SessionRecord:
    return SessionRecord(sid, sid, 0.0, 0.0, False, None, "m", b"", False, None, None)


def _write_messages(path: str, sid: str, count: int) -> None:
    """Child process: one transaction per message, as a streaming reply writes."""
    store = Store(path)
    for i in range(count):
        message = MessageRecord(
            f"{sid}-{i}", i, "user", f"message {i}", "complete", None, None, False, True, None, 0.0
        )
        store.save(_session(sid), [message])
    store.close()


def test_two_processes_writing_one_database_lose_nothing(tmp_path) -> None:
    path = str(tmp_path / "db.sqlite3")
    Store(path).close()  # created and migrated once
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_write_messages, args=(path, sid, 200)) for sid in ("p1", "p2")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    store = Store(path)
    loaded = {record.id: messages for record, messages in store.load()}
    assert {sid: len(m) for sid, m in loaded.items()} == {"p1": 200, "p2": 200}
    assert store.integrity_ok()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


_CHILD = textwrap.dedent(
    """
    import sys, threading
    from kvchat.chat.events import ReplyDelta
    from kvchat.chat.service import SessionService
    from kvchat.chat.store import Store
    from kvchat.testing.fake_engine import CharRenderer, FakeEngine

    engine = FakeEngine(manual=True, tokens_per_reply=1000)
    renderer = CharRenderer()
    service = SessionService(engine, renderer, Store(sys.argv[1]),
        stop_token_ids=renderer.stop_token_ids, save_interval_s=3600, save_every_tokens=4)
    seen = threading.Semaphore(0)
    service.subscribe(lambda e: seen.release() if isinstance(e, ReplyDelta) else None)
    sid = service.create_session("doomed")
    service.say(sid, "tell me a long story")
    engine.advance(6)
    for _ in range(6):
        seen.acquire()
    service.flush()
    print("saved", flush=True)
    sys.stdin.read()  # hold the reply open until killed
    """
)


def test_reply_of_a_killed_process_is_kept_as_interrupted(tmp_path) -> None:
    db = tmp_path / "db.sqlite3"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(db)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "saved"
        # while it lives, its streaming message is not touched by another opener
        peek = Store(db)
        assert peek.interrupted_on_open == 0
        peek.close()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)  # reaped: a zombie would still look alive
    assert child.returncode == -signal.SIGKILL

    store = Store(db)
    assert store.interrupted_on_open == 1
    (record, messages), *_ = store.load()
    reply = messages[-1]
    assert reply.state == "interrupted" and reply.owner_pid is None
    assert len(reply.content) == 4  # saved every 4 tokens: what was written survives
    ids = record.ids()
    assert "".join(chr(i) for i in ids[-4:]) == reply.content  # ids and text agree

    engine, renderer = FakeEngine(), CharRenderer()
    service = SessionService(engine, renderer, store, stop_token_ids=renderer.stop_token_ids)
    try:
        sid = record.id
        assert service.messages(sid)[-1].state == MessageState.INTERRUPTED
        service.say(sid, "go on")
        assert service.wait_idle(sid, timeout=10)
        assert engine.submitted[0].prompt_ids[: len(ids)] == tuple(ids)
    finally:
        service.close()
        engine.close()


def test_schema_is_versioned_and_a_newer_database_is_refused(tmp_path) -> None:
    path = tmp_path / "db.sqlite3"
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    store.close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(KvchatError, match="newer kvchat"):
        Store(path)


def test_a_file_that_is_not_a_database_gives_a_message(tmp_path) -> None:
    path = tmp_path / "db.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(KvchatError, match="Move the file away"):
        Store(path)


def test_a_database_of_the_schema_before_gets_the_model_name_column(tmp_path) -> None:
    """A session stored before sessions kept their model's name loads with none."""
    import sqlite3

    from kvchat.chat import store as store_module

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    for step in store_module._MIGRATIONS[: SCHEMA_VERSION - 1]:
        db.executescript(step)
    db.execute(
        "INSERT INTO sessions (id, title, created, updated, model_fingerprint) "
        "VALUES ('s1', 'old one', 1.0, 1.0, 'fp')"
    )
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    db.commit()
    db.close()
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        ((record, _),) = store.load()
        assert (record.title, record.model_name) == ("old one", "")
    finally:
        store.close()
