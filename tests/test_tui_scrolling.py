"""The transcript scrolls from the composer: pageup / pagedown a page, ctrl+home /
ctrl+end to either end; the focus, and what is being typed, stay in the composer."""

from __future__ import annotations

import time

from kvchat.chat.store import MessageRecord, SessionRecord, Store
from kvchat.testing.tui import fake_app, ready, wait_until

SIZE = (100, 30)


def a_long_stored_conversation(path) -> None:
    store = Store(path)
    now = time.time() - 3600
    record = SessionRecord("s1", "long", now, now, False, None, "fake-model", b"", True, None, None)
    messages = []
    for i in range(30):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"message {i}: " + "words " * 30
        messages.append(
            MessageRecord(f"m{i}", i, role, text, "complete", None, None, False, True, None, now)
        )
    store.save(record, messages)
    store.close()


async def test_page_keys_scroll_the_transcript_while_the_composer_keeps_the_focus(tmp_path):
    a_long_stored_conversation(tmp_path / "db.sqlite3")
    app, _ = fake_app(store=Store(tmp_path / "db.sqlite3"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        transcript = app.chat.transcript
        await wait_until(
            pilot,
            lambda: transcript.max_scroll_y > 0 and transcript.scroll_y == transcript.max_scroll_y,
            what="the end of a long transcript in view",
        )
        await pilot.press(*"half a thought")
        end = transcript.scroll_y
        await pilot.press("pageup")
        await wait_until(pilot, lambda: transcript.scroll_y < end, what="a page up")
        assert not transcript.following  # a reply arriving now would not pull the view
        await pilot.press("ctrl+home")
        await wait_until(pilot, lambda: transcript.scroll_y == 0, what="the top")
        await pilot.press("pagedown")
        await wait_until(pilot, lambda: transcript.scroll_y > 0, what="a page down")
        await pilot.press("ctrl+end")
        await wait_until(
            pilot, lambda: transcript.scroll_y == transcript.max_scroll_y, what="the end"
        )
        assert transcript.following
        assert app.focused is app.chat.composer and app.chat.composer.text == "half a thought"
