"""Two kvchat processes sending into one session of one database lose no turn.

The model (see `chat/store.py`): appends cannot collide. A message's seq is
allocated inside the write transaction, a user message and its reply are written
in one transaction, and a process that finds the session written by another since
its last save is told so (a notice) and stores its token ids as stale, so the next
start renders the session from all its messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from kvchat.chat.persistence import DIVERGED_NOTICE
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.testing.fake_engine import CharRenderer, FakeEngine

ROOT = Path(__file__).resolve().parents[1]
TURNS = 12

_WRITER = textwrap.dedent(
    """
    import json, sys
    from kvchat.chat.events import ReplyFinished
    from kvchat.chat.service import SessionService
    from kvchat.chat.store import Store
    from kvchat.testing.fake_engine import CharRenderer, FakeEngine

    db, sid, tag, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine, renderer = FakeEngine(), CharRenderer()
    service = SessionService(engine, renderer, Store(db), stop_token_ids=renderer.stop_token_ids,
                             save_interval_s=0.0, save_every_tokens=1)
    replies = []
    service.subscribe(lambda e: replies.append(e.text) if isinstance(e, ReplyFinished) else None)
    print("ready", flush=True)
    sys.stdin.readline()  # both processes start sending together
    acknowledged = []
    for i in range(turns):
        text = f"{tag} message {i}"
        service.say(sid, text)
        assert service.wait_idle(sid, 30)
        acknowledged.append([text, replies[-1]])
    report = service.close()
    engine.close()
    print(json.dumps({"acknowledged": acknowledged, "unsaved": report is not None}), flush=True)
    """
)


def make_service(db: Path) -> tuple[SessionService, FakeEngine]:
    engine, renderer = FakeEngine(), CharRenderer()
    return SessionService(engine, renderer, Store(db), stop_token_ids=renderer.stop_token_ids), (
        engine
    )


def test_two_processes_sending_into_one_session_lose_no_turn(tmp_path) -> None:
    db = tmp_path / "sessions.sqlite3"
    service, engine = make_service(db)
    sid = service.create_session("shared")
    service.say(sid, "before both")
    assert service.wait_idle(sid, 10)
    service.close()
    engine.close()

    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(db), sid, tag, str(TURNS)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("left", "right")
    ]
    try:
        for w in writers:
            assert w.stdout is not None and w.stdout.readline().strip() == "ready"
        for w in writers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        results = [json.loads(w.communicate(timeout=120)[0]) for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait()
    assert [w.returncode for w in writers] == [0, 0]
    assert not any(r["unsaved"] for r in results)

    store = Store(db)
    try:
        assert store.integrity_ok()
        ((record, messages),) = store.load()
    finally:
        store.close()
    stored = [(m.role, m.content, m.state) for m in messages]
    assert len(stored) == 2 + 2 * 2 * TURNS
    for result in results:
        assert len(result["acknowledged"]) == TURNS
        for text, reply in result["acknowledged"]:
            i = stored.index(("user", text, "complete"))
            assert stored[i + 1] == ("assistant", reply, "complete")  # its reply right after it
    assert record.ids_stale  # both wrote: neither's ids render the other's turns


def test_a_process_learns_another_wrote_its_session_and_the_next_start_renders_all(
    tmp_path,
) -> None:
    db = tmp_path / "sessions.sqlite3"
    first, first_engine = make_service(db)
    sid = first.create_session("shared")
    assert first.flush(10)
    second, second_engine = make_service(db)  # loads the session as it is now
    notices = []
    second.subscribe(lambda e: notices.append(getattr(e, "text", None)))
    try:
        first.say(sid, "from the first")
        assert first.wait_idle(sid, 10) and first.flush(10)
        second.say(sid, "from the second")
        assert second.wait_idle(sid, 10) and second.flush(10)
        assert DIVERGED_NOTICE in notices
        assert second.session(sid).notice == DIVERGED_NOTICE
    finally:
        for service, engine in ((first, first_engine), (second, second_engine)):
            assert service.close() is None
            engine.close()

    again, engine = make_service(db)
    try:
        assert [m.content for m in again.messages(sid) if m.role == "user"] == [
            "from the first",
            "from the second",
        ]
        again.say(sid, "third")
        assert again.wait_idle(sid, 10)
        renderer = CharRenderer()
        everything = [{"role": m.role, "content": m.content} for m in again.messages(sid)[:-1]]
        # rendered from every stored message, not from either process's own ids
        assert list(engine.submitted[-1].prompt_ids) == renderer.prompt_ids(everything)
    finally:
        again.close()
        engine.close()


def test_an_edit_in_one_process_never_deletes_the_other_process_turns(tmp_path) -> None:
    db = tmp_path / "sessions.sqlite3"
    first, first_engine = make_service(db)
    sid = first.create_session("shared")
    first.say(sid, "first's question")
    assert first.wait_idle(sid, 10) and first.flush(10)
    second, second_engine = make_service(db)
    try:
        second.say(sid, "second's question")
        assert second.wait_idle(sid, 10) and second.flush(10)
        first.regenerate(sid)  # drops and rewrites first's last reply
        assert first.wait_idle(sid, 10)
        first.edit_last_user_message(sid, "first's question, edited")
        assert first.wait_idle(sid, 10)
        first.set_system_prompt(sid, "Be brief.")
        assert first.flush(10)
    finally:
        for service, engine in ((first, first_engine), (second, second_engine)):
            assert service.close() is None
            engine.close()
    store = Store(db)
    try:
        ((_, messages),) = store.load()
    finally:
        store.close()
    assert [(m.role, m.content) for m in messages if m.role != "assistant"] == [
        ("system", "Be brief."),
        ("user", "second's question"),
        ("user", "first's question, edited"),
    ]
    assert [m.role for m in messages] == ["system", "user", "assistant", "user", "assistant"]


def test_undo_of_a_delete_survives_another_process_purging_it_at_its_start(tmp_path) -> None:
    db = tmp_path / "sessions.sqlite3"
    first, first_engine = make_service(db)
    try:
        sid = first.create_session("kept after all")
        first.say(sid, "do not lose me")
        assert first.wait_idle(sid, 10)
        first.delete(sid)
        assert first.flush(10)
        starting, starting_engine = make_service(db)  # purges what was deleted before it
        starting.close()
        starting_engine.close()
        first.undo_delete(sid)
        assert first.flush(10)
    finally:
        first.close()
        first_engine.close()
    again, engine = make_service(db)
    try:
        messages = again.messages(sid)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[0].content == "do not lose me" and messages[1].content
    finally:
        again.close()
        engine.close()
