"""Pilot-driven tests of the TUI on the fake engine: streaming, switching, commands, restore.

The fake engine runs in manual mode, so a reply is held mid-stream until the
test calls `advance()`; every wait is on a condition (`wait_until`), never a sleep.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from textual import events
from textual.command import CommandList, CommandPalette
from textual.widgets import Label, Static

from kvchat.chat.session import MessageState
from kvchat.chat.settings import Settings
from kvchat.chat.store import MessageRecord, SessionRecord, Store
from kvchat.errors import ModelLoadError
from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until
from kvchat.tui.app import GIL_SWITCH_INTERVAL_S, KvchatApp
from kvchat.tui.screens import FailedStartScreen, StartupScreen
from kvchat.tui.sidebar import SessionList
from tests.tui_helpers import transcript_texts

SIZE = (150, 45)


def notifications(app: KvchatApp) -> list[str]:
    return [n.message for n in app._notifications]


def first_command(app: KvchatApp) -> str:
    """The first option the command palette shows now ("" when none)."""
    if not isinstance(app.screen, CommandPalette):
        return ""
    options = app.screen.query_one(CommandList)
    if options.option_count == 0:
        return ""
    prompt = options.get_option_at_index(0).prompt
    return getattr(prompt, "plain", str(prompt)).splitlines()[0]


async def type_and_send(pilot, text: str) -> None:
    await pilot.press(*text)
    await pilot.press("enter")


async def test_sessions_stream_switch_stop_regenerate_fork_archive_and_attach(tmp_path):
    app, engine = fake_app(manual=True, tokens_per_reply=12)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        service = app.service
        await pilot.press("ctrl+n")  # the key makes the first; an empty one is reused after
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 1, what="a session")
        await new_sessions(pilot, app, 2)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 3, what="three sessions")
        first, second, third = app.chat.sidebar.order  # creation order, numbered 1, 2, 3
        assert app.chat.current == third

        # send in two sessions; both stream at once (the engine holds them mid-reply)
        await type_and_send(pilot, "alpha")
        await wait_until(pilot, lambda: service.session(third).state != "idle", what="alpha starts")
        await pilot.press("alt+up")
        assert app.chat.current == second
        await type_and_send(pilot, "beta")
        await wait_until(pilot, lambda: service.session(second).state != "idle", what="beta starts")
        engine.advance(4)
        await wait_until(
            pilot,
            lambda: all(app.chat.views[s].state == "decoding" for s in (second, third)),
            what="both decoding in the sidebar",
        )
        await wait_until(
            pilot,
            lambda: transcript_texts(app)[-1][2] == service.messages(second)[-1].content != "",
            what="the visible reply streams",
        )
        assert app.chat.sidebar.rows()[second].view.title == "beta"

        # switch while both stream: the other session renders at once, its text so far
        await pilot.press("ctrl+pagedown")
        assert app.chat.current == third
        assert [t[0] for t in transcript_texts(app)] == ["user", "assistant"]
        assert transcript_texts(app)[0][2] == "alpha"
        shown = transcript_texts(app)[-1][2]
        assert shown and service.messages(third)[-1].content.startswith(shown)
        assert engine.prefetched, "a switch tells the engine to prefetch"

        # stop the visible one; the hidden one keeps generating and ends unread
        await pilot.press("escape")
        engine.advance(30)
        await wait_until(
            pilot, lambda: transcript_texts(app)[-1][1] == "cancelled", what="stopped reply"
        )
        assert "stopped" in str(app.chat.transcript.blocks()[-1].header.render())
        await wait_until(
            pilot, lambda: app.chat.views[second].state == "idle", what="beta finishes"
        )
        assert app.chat.views[second].unread
        assert service.messages(second)[-1].state == MessageState.COMPLETE

        # regenerate the stopped reply: a new one replaces it and streams to the end
        await pilot.press("ctrl+r")
        engine.advance(40)
        await wait_until(
            pilot,
            lambda: [t[1] for t in transcript_texts(app)] == ["complete", "complete"],
            what="regenerated reply",
        )
        final = service.messages(third)[-1].content
        assert transcript_texts(app)[-1][2] == final and len(final) == 12

        # fork at the end through the command palette
        await pilot.press("ctrl+p")
        await pilot.press(*"Fork at message")
        await wait_until(pilot, lambda: first_command(app).startswith("Fork"), what="palette")
        await pilot.press("enter")
        await wait_until(pilot, lambda: first_command(app) == "Fork at the end", what="fork list")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 4, what="the fork")
        fork = app.chat.current
        assert fork not in (first, second, third)
        assert app.chat.views[fork].title.endswith("(fork)")
        assert [t[2] for t in transcript_texts(app)] == ["alpha", final]

        # archive, then undo
        await pilot.press("f6")
        await wait_until(pilot, lambda: fork not in app.chat.sidebar.order, what="archived")
        assert app.chat.current != fork
        await pilot.press("f9")
        await wait_until(pilot, lambda: app.chat.current == fork, what="undo brings it back")
        assert fork in app.chat.sidebar.order and not service.session(fork).archived

        # attach a file's text, ask about it
        doc = tmp_path / "notes.txt"
        doc.write_text("the cache keeps pages\n", encoding="utf-8")
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: app.screen is not app.chat, what="attach dialog")
        await pilot.press(*str(doc))
        await pilot.press("enter")
        await wait_until(
            pilot, lambda: [a.name for a in app.chat.composer.attachments] == ["notes.txt"]
        )
        assert app.chat.composer.text == ""  # the file is a chip, not text in the box
        await type_and_send(pilot, "what does it say?")
        await wait_until(pilot, lambda: len(transcript_texts(app)) == 4, what="attached message")
        sent = service.messages(fork)[2].content
        assert "notes.txt" in sent and "the cache keeps pages" in sent
        assert sent.rstrip().endswith("what does it say?")
        engine.advance(40)
        await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete")


async def test_hidden_session_finishes_and_every_token_reaches_the_transcript():
    app, engine = fake_app(manual=True, tokens_per_reply=50)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current is not None)
        visible = app.chat.current
        await type_and_send(pilot, "one")
        await wait_until(pilot, lambda: app.service.session(visible).state != "idle")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current != visible)
        hidden = app.chat.current
        await type_and_send(pilot, "two")
        await wait_until(pilot, lambda: app.service.session(hidden).state != "idle")
        await pilot.press("alt+1")
        assert app.chat.current == visible
        for _ in range(60):
            engine.advance(1)
            await pilot.pause()
        await wait_until(pilot, lambda: app.service.session(hidden).state == "idle")
        await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete")
        assert transcript_texts(app)[-1][2] == app.service.messages(visible)[-1].content
        assert len(app.service.messages(hidden)[-1].content) == 50
        assert app.chat.views[hidden].unread and not app.chat.views[visible].unread


async def test_a_message_that_cannot_be_sent_comes_back_to_the_composer():
    """Sending only submits (the service sizes the turn on its own thread, which may ask a
    server); a refusal is shown and the text is back in the composer, not lost."""
    app, engine = fake_app(context_length=64)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        text = " ".join(["too long"] * 20)
        app.chat.composer.load_text(text)
        await pilot.press("enter")
        await wait_until(
            pilot, lambda: any("does not fit" in n for n in notifications(app)), what="refusal"
        )
        await wait_until(pilot, lambda: app.chat.composer.text == text, what="the text back")
        assert not [m for m in app.service.messages(app.chat.current) if m.role == "user"]
        assert engine.submitted == []


async def test_edit_and_resend_replaces_the_last_message():
    app, _ = fake_app(tokens_per_reply=6)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "frist")  # no session yet: sending creates one
        await wait_until(pilot, lambda: len(transcript_texts(app)) == 2)
        await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete")
        await pilot.press("f3")
        assert app.chat.composer.editing and app.chat.composer.text == "frist"
        app.chat.composer.load_text("first")
        await pilot.press("enter")
        await wait_until(
            pilot, lambda: transcript_texts(app)[:1] == [("user", "complete", "first")]
        )
        await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete")
        assert [m.content for m in app.service.messages(app.chat.current) if m.role == "user"] == [
            "first"
        ]


async def test_keys_typed_while_start_up_lists_the_sessions_reach_the_composer(monkeypatch):
    """A key that arrives while start-up is still listing the sessions (after the model is
    loaded) lands in the composer; it used to go nowhere, because the composer was focused
    only at the very end (seen as a lost first letter in CI)."""
    app, _ = fake_app(tokens_per_reply=2)
    list_sessions = SessionList.set_sessions

    async def list_while_a_key_arrives(sidebar: SessionList, views) -> None:
        app.post_message(events.Key("x", "x"))  # queued behind whatever start-up queued so far
        await list_sessions(sidebar, views)

    monkeypatch.setattr(SessionList, "set_sessions", list_while_a_key_arrives)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await wait_until(
            pilot, lambda: app.chat.composer.text == "x", what="the key in the composer"
        )


async def typed_at_start_up(pilot, app: KvchatApp, keys: list[str]) -> None:
    await wait_until(pilot, lambda: isinstance(app.screen, StartupScreen), what="start-up")
    await pilot.press(*keys)


@pytest.mark.parametrize("send", [False, True])
async def test_what_is_typed_while_the_model_loads_is_kept_and_sent_when_asked(send):
    """Keys typed on the start-up screen reach the composer; a message sent there is sent
    once the model is ready (before, the start-up screen swallowed every key)."""
    loaded = threading.Event()
    app, _ = fake_app(tokens_per_reply=3, loaded=loaded)
    async with app.run_test(size=SIZE) as pilot:
        await typed_at_start_up(pilot, app, ["f1", "ctrl+p", "ctrl+n"])  # off until ready
        assert isinstance(app.screen, StartupScreen) and app.screen.typed == ""
        await pilot.press(*"early bird", *(["enter"] if send else []))
        if send:
            hint = app.screen.query_one("#startup-hint", Label)
            await wait_until(pilot, lambda: "sent as soon as" in str(hint.render()))
        loaded.set()
        await ready(pilot, app)
        if send:
            await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete")
            assert transcript_texts(app)[0] == ("user", "complete", "early bird")
            assert app.chat.composer.text == ""
        else:
            assert app.chat.composer.text == "early bird" and not transcript_texts(app)[1:]
            await pilot.press("!")  # the cursor is at the end of the text typed
            assert app.chat.composer.text == "early bird!"


async def test_a_failed_start_shows_what_was_typed_while_it_loaded():
    loaded = threading.Event()
    app, _ = fake_app(loaded=loaded)

    def fail(progress):
        loaded.wait(30)
        raise ModelLoadError("the model file is missing: run `kvchat model fetch`")

    app.backend_factory = fail
    async with app.run_test(size=SIZE) as pilot:
        await typed_at_start_up(pilot, app, [*"keep me"])
        loaded.set()
        await wait_until(pilot, lambda: isinstance(app.screen, FailedStartScreen))
        shown = str(app.screen.query_one("#failed-message", Static).render())
        assert "model file is missing" in shown and shown.endswith("(not sent):\nkeep me")


async def test_interrupted_reply_is_restored_and_marked(tmp_path):
    store = Store(tmp_path / "db.sqlite3")
    now = time.time()
    store.save(
        SessionRecord(
            "s1", "restored chat", now, now, False, None, "fake-model", b"", True, None, None
        ),
        [
            MessageRecord("m1", 0, "user", "tell me", "complete", None, 0, False, True, None, now),
            MessageRecord(
                "m2",
                1,
                "assistant",
                "half a rep",
                "streaming",
                None,
                None,
                False,
                True,
                2**22 + 7,
                now,
            ),
        ],
    )
    store.close()
    app, _ = fake_app(store=Store(tmp_path / "db.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await wait_until(pilot, lambda: app.chat.current == "s1", 20, "the restored session shown")
        assert app.chat.sidebar.rows()["s1"].view.title == "restored chat"
        assert transcript_texts(app) == [
            ("user", "complete", "tell me"),
            ("assistant", "interrupted", "half a rep"),
        ]
        assert "interrupted" in str(app.chat.transcript.blocks()[-1].header.render())
        assert any("interrupted" in n for n in notifications(app))


async def test_bad_settings_are_reported_and_keys_remap_by_id():
    settings = Settings(keys={"next_session": "ctrl+right", "no_such_action": "x"})
    app, _ = fake_app(settings=settings, settings_problem="settings.toml, line 3: bad value")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        texts = notifications(app)
        assert any("line 3" in t for t in texts)
        assert any("no_such_action" in t for t in texts)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 1)
        await new_sessions(pilot, app, 1)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 2)
        older, newest = app.chat.sidebar.order
        assert app.chat.current == newest
        await pilot.press("ctrl+right")
        assert app.chat.current == older


async def test_missing_model_shows_what_to_do_and_quits():
    def broken(progress):
        progress("Looking for the model...")
        raise ModelLoadError("No model at /nowhere. Pass --model with a folder or a GGUF file.")

    app = KvchatApp(broken, store_factory=Store.in_memory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FailedStartScreen), what="screen")
        assert "Pass --model" in str(app.screen.query_one("#failed-message").render())
        await pilot.press("q")
    assert app.return_code == 1


async def test_copy_export_rename_and_sampling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app, _ = fake_app(tokens_per_reply=5)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "hi")
        await wait_until(
            pilot, lambda: transcript_texts(app)[-1:] and transcript_texts(app)[-1][1] == "complete"
        )
        reply = app.service.messages(app.chat.current)[-1].content
        await pilot.press("f4")
        assert app.clipboard == reply
        await pilot.press("f2")
        await wait_until(pilot, lambda: app.screen is not app.chat)
        await pilot.press("ctrl+u", *"Renamed", "enter")
        await wait_until(pilot, lambda: app.chat.views[app.chat.current].title == "Renamed")
        assert app.chat.transcript.border_title == "Renamed"
        app.chat.action_export()
        await pilot.pause()
        await pilot.press("enter")
        await wait_until(pilot, lambda: (tmp_path / "renamed.md").exists())
        assert reply in (tmp_path / "renamed.md").read_text(encoding="utf-8")
        app.chat.action_sampling()
        await pilot.pause()
        await pilot.press("ctrl+u", *"temperature=0.2 max_tokens=9", "enter")
        await wait_until(pilot, lambda: app.service.session(app.chat.current).max_tokens == 9)
        assert app.service.session(app.chat.current).sampling.temperature == 0.2


async def test_the_cache_note_follows_the_backend_as_it_changes(monkeypatch):
    """The note names the attention in use; the kernel may finish compiling after start."""
    import kvchat.tui.frame_pump as frame_pump

    monkeypatch.setattr(frame_pump, "NOTE_EVERY_S", 0.0)
    note = ["attention: torch SDPA while kvchat's kernel compiles"]
    app, _engine = fake_app(describe=lambda: note[0])
    async with app.run_test(size=(160, 45)) as pilot:
        await ready(pilot, app)
        await wait_until(pilot, lambda: "compiles" in app.chat.meters.values["cache"], 10)
        note[0] = "attention: kvchat's CPU kernel"
        await wait_until(pilot, lambda: "CPU kernel" in app.chat.meters.values["cache"], 10)


async def test_the_gil_hands_over_every_millisecond_while_the_app_runs():
    """The engine thread gets the GIL back from a long screen update within 1 ms, not
    Python's 5 ms; the interval the process had is restored when the app ends."""
    before = sys.getswitchinterval()
    app, _ = fake_app(tokens_per_reply=2)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == pytest.approx(before)


async def test_new_session_reuses_an_empty_one_instead_of_piling_them_up():
    """ctrl+n on an empty session stays there; from a session with messages it goes to
    the empty one already listed; text typed into a session makes it not empty."""
    app, _ = fake_app(tokens_per_reply=3)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current is not None, what="a session")
        empty = app.chat.current
        for _ in range(3):
            await pilot.press("ctrl+n")
            await pilot.pause()
        assert app.chat.sidebar.order == [empty] and app.chat.current == empty

        await type_and_send(pilot, "hello")
        await wait_until(pilot, lambda: app.service.session(empty).state == "idle", what="reply")
        await wait_until(pilot, lambda: app.service.session(empty).message_count == 2, what="kept")
        await pilot.press("ctrl+n")  # from a chat with messages: a new, empty one
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 2, what="session two")
        second = app.chat.current
        assert second != empty
        await pilot.press(*"half a thought")  # typed, not sent: this one is in use
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 3, what="session three")
        third = app.chat.current
        await pilot.press("alt+1")
        assert app.chat.current == empty
        await pilot.press("ctrl+n")  # the empty one listed is reused
        await wait_until(pilot, lambda: app.chat.current == third, what="the empty session")
        assert len(app.chat.sidebar.order) == 3
        await pilot.press("alt+2")
        assert app.chat.composer.text == "half a thought"


async def test_attaching_says_the_messages_size_at_once_and_by_how_much_it_is_too_long(
    tmp_path,
):
    """The count comes with the attachment, not at the send that fails; a file too long
    for the context says by how many tokens, and so does the send's error."""
    small, big = tmp_path / "notes.md", tmp_path / "book.md"
    small.write_text("a few lines of notes\n")
    big.write_text("word " * 2000)  # the fake renderer: a token a character
    app, _ = fake_app(context_length=4096)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current is not None, what="a session")
        app.chat.attach_file(small)
        await wait_until(
            pilot,
            lambda: any("Attached notes.md: the message is" in t and "tokens of the" in t
                        for t in notifications(app)),
            what="the size",
        )  # fmt: skip
        app.chat.composer.clear()
        app.chat.attach_file(big)
        await wait_until(
            pilot, lambda: any("book.md" in t for t in notifications(app)), what="the warning"
        )
        warning = next(n for n in app._notifications if "book.md" in n.message)
        assert warning.severity == "warning" and "more than a prompt can hold" in warning.message
        await pilot.press("enter")  # sent anyway: refused, with the excess
        await wait_until(
            pilot,
            lambda: any("tokens too many" in t for t in notifications(app)),
            what="the refusal",
        )
