"""The transcript keeps the newest message in view: after a start, when a message is sent
(drawn and its first text flushed before a layout included), while a reply streams; not
after the user scrolled up, and again once the user scrolled back to the end.

Pilot on the fake engine over a stored session longer than the screen; every wait is on
a condition (`wait_until`), never a sleep.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvchat.chat.session import MessageState, MessageView
from kvchat.chat.store import MessageRecord, SessionRecord, Store
from kvchat.testing.tui import fake_app, ready, wait_until
from kvchat.tui.app import KvchatApp
from kvchat.tui.stream_buffer import Chunk
from kvchat.tui.transcript import MessageBlock

SIZE = (150, 45)
COMPLETE, STREAMING = MessageState.COMPLETE, MessageState.STREAMING
PAIRS = 20  # 40 messages: about three screens of transcript
MAX_TOKENS = 400  # the session's own limit: room for a reply taller than the view


def store_long_session(path: Path) -> None:
    """One session of `PAIRS` questions and answers, as an earlier run left it."""
    store = Store(path)
    now = time.time()
    messages = []
    for i in range(PAIRS):
        for role, text in (("user", f"question {i}"), ("assistant", f"answer {i}")):
            messages.append(
                MessageRecord(
                    f"{role}{i}", len(messages), role, text, "complete", None, None, False,
                    True, None, now,
                )
            )  # fmt: skip
    store.save(
        SessionRecord(
            "s1", "long chat", now, now, False, None, "fake-model", b"", True, None, MAX_TOKENS
        ),
        messages,
    )
    store.close()


def in_view(app: KvchatApp, block: MessageBlock) -> bool:
    return app.chat.transcript.can_view_entire(block)


def last_turn_shown_finished(app: KvchatApp, text: str) -> bool:
    """The message `text` and its finished reply are the last blocks, both wholly in view."""
    blocks = app.chat.transcript.blocks()
    return (
        len(blocks) >= 2
        and blocks[-2].message.content == text
        and blocks[-1].message.role == "assistant"
        and str(blocks[-1].message.state) == "complete"
        and in_view(app, blocks[-2])
        and in_view(app, blocks[-1])
    )


async def started_on_the_long_session(pilot, app: KvchatApp) -> None:
    await ready(pilot, app)
    await wait_until(
        pilot,
        lambda: app.chat.current == "s1" and len(app.chat.transcript.blocks()) == 2 * PAIRS,
        what="the stored session rendered",
    )


async def test_a_start_shows_the_end_of_a_session_longer_than_the_screen(tmp_path):
    store_long_session(tmp_path / "db.sqlite3")
    app, _ = fake_app(store=Store(tmp_path / "db.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        await started_on_the_long_session(pilot, app)
        last = app.chat.transcript.blocks()[-1]
        await wait_until(pilot, lambda: in_view(app, last), what="the last answer in view")
        assert app.chat.transcript.max_scroll_y > 0  # longer than the view: it had to scroll
        assert not in_view(app, app.chat.transcript.blocks()[0])


async def test_a_message_sent_after_scrolling_up_is_shown_finished_with_its_reply(tmp_path):
    store_long_session(tmp_path / "db.sqlite3")
    app, engine = fake_app(store=Store(tmp_path / "db.sqlite3"), manual=True, tokens_per_reply=24)
    async with app.run_test(size=SIZE) as pilot:
        await started_on_the_long_session(pilot, app)
        transcript = app.chat.transcript
        for turn in range(3):
            # the user reads earlier messages, then sends one: it must come into view
            transcript.scroll_home(animate=False)
            await wait_until(pilot, lambda: transcript.scroll_offset.y == 0, what="scrolled up")
            text = f"new turn {turn}"
            engine.advance(200)  # the whole reply computed as soon as it is submitted
            await pilot.press(*text, "enter")
            await wait_until(
                pilot,
                lambda t=text: last_turn_shown_finished(app, t),
                what=f"{text!r} and its reply shown finished in view",
            )


async def test_a_message_drawn_and_its_first_text_flushed_before_a_layout_come_into_view(tmp_path):
    """The order a busy UI thread runs them in: a tick flushes the reply's first text right
    after the message was drawn, before the screen laid the new blocks out; the text's
    Markdown mounts in a batched update, and Textual then runs the scroll asked for by
    the new message without a layout (it lands on the old end)."""
    store_long_session(tmp_path / "db.sqlite3")
    app, _ = fake_app(store=Store(tmp_path / "db.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        await started_on_the_long_session(pilot, app)
        # the start's focus (and the SessionChanged it sends) handled: nothing else
        # re-renders the session while the test draws into it
        await wait_until(pilot, lambda: not [w for w in app.workers if w.group == "focus"])
        await pilot.pause()
        assert app.service is not None
        transcript = app.chat.transcript
        messages = app.service.messages("s1")
        for turn in range(3):
            transcript.scroll_home(animate=False)  # the user reads earlier messages
            await wait_until(pilot, lambda: transcript.scroll_offset.y == 0, what="scrolled up")
            n = len(messages)
            reply = MessageView(f"reply{turn}", n + 1, "assistant", "", STREAMING, True, None)
            user = MessageView(f"sent{turn}", n, "user", f"sent {turn}", COMPLETE, True, None)
            messages = [*messages, user, reply]
            await transcript.sync("s1", messages)
            await transcript.append(Chunk(reply.id, 0, f"the first words of reply {turn}"))
            blocks = transcript.blocks()[-2:]
            await wait_until(
                pilot,
                lambda b=blocks: all(in_view(app, block) for block in b),
                what=f"message {turn} and its reply in view",
            )


async def test_a_streaming_reply_is_followed_until_the_user_scrolls_up_and_again_at_the_end(
    tmp_path,
):
    store_long_session(tmp_path / "db.sqlite3")
    paragraphs = "\n\n".join(f"line {i}" for i in range(30))  # far taller than the view
    app, engine = fake_app(
        store=Store(tmp_path / "db.sqlite3"), manual=True, reply_text=lambda _r: paragraphs
    )
    async with app.run_test(size=SIZE) as pilot:
        await started_on_the_long_session(pilot, app)
        transcript = app.chat.transcript
        await pilot.press(*"tell me a lot", "enter")
        engine.advance(60)
        await wait_until(
            pilot,
            lambda: transcript.blocks()[-1].shown >= 40 and transcript.following,
            what="the reply streaming",
        )

        # the user scrolls up: the text that comes next does not pull the view down
        transcript.scroll_home(animate=False)
        await wait_until(pilot, lambda: not transcript.following, what="the view let go")
        engine.advance(60)
        grown = transcript.max_scroll_y
        await wait_until(
            pilot,
            lambda: transcript.blocks()[-1].shown >= 100 and transcript.max_scroll_y > grown,
            what="more of the reply, taller",
        )
        await pilot.pause()
        assert transcript.scroll_offset.y == 0

        # back at the end, the view follows the reply again to its last line
        transcript.scroll_end(animate=False)
        await wait_until(pilot, lambda: transcript.following, what="following again")
        engine.advance(len(paragraphs))
        reply = transcript.blocks()[-1]
        await wait_until(
            pilot,
            lambda: str(reply.message.state) == "complete" and transcript.is_vertical_scroll_end,
            what="the whole reply followed to its end",
        )
        assert "line 29" in reply.body.source
