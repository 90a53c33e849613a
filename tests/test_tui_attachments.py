"""Attached files are chips above the composer: counted at once, removable by click or
backspace, kept with their session's unsent text across switches and a restart, sent
before the typed text, and chips again when the message is edited."""

from __future__ import annotations

from kvchat.chat.attachments import attach, message_with, split_message
from kvchat.chat.store import Store
from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until
from kvchat.tui.attachment_chips import AttachmentChip

SIZE = (150, 45)


def chip_texts(app) -> list[str]:
    return [str(chip.render()) for chip in app.chat.query(AttachmentChip)]


def test_a_message_splits_back_into_its_files_and_text(tmp_path):
    (tmp_path / "a.md").write_text("fenced ``` inside\n")
    (tmp_path / "empty.txt").write_text("")
    a, empty = attach(tmp_path / "a.md"), attach(tmp_path / "empty.txt")
    for files, text in [((), ""), ((a,), ""), ((a, empty), "what is it?"), ((a,), "\n\nx")]:
        message = message_with(files, text)
        assert split_message(message) == (files, text)
        sent = message.strip()  # as a send stores it
        assert message_with(*split_message(sent)).strip() == sent
    for plain in ["File `x`:\n\n```\nabc\n```\nno blank line after", "hi", "File `x`:\n\n```"]:
        assert split_message(plain) == ((), plain)


async def test_attachments_are_chips_that_can_be_removed_and_survive_a_restart(tmp_path):
    path = tmp_path / "sessions.db"
    notes, book = tmp_path / "notes.md", tmp_path / "book.md"
    notes.write_text("the cache keeps pages\n")
    book.write_text("chapter one\n")
    app, engine = fake_app(store=Store(path), manual=True, tokens_per_reply=4)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await new_sessions(pilot, app, 2)
        first, second = app.chat.sidebar.order
        await pilot.press("alt+1")
        app.chat.attach_file(notes)
        app.chat.attach_file(book)
        await wait_until(pilot, lambda: len(chip_texts(app)) == 2, what="two chips")
        assert app.chat.composer.text == ""
        counted = chip_texts(app)
        assert counted[0].startswith("notes.md · ") and "tokens" in counted[0]
        assert app.chat.attachment_chips.display
        # backspace at the start of the box takes the last chip off, not a character
        await pilot.press(*"ab", "left", "left", "backspace")
        await wait_until(pilot, lambda: len(chip_texts(app)) == 1, what="one chip left")
        assert app.chat.composer.text == "ab" and chip_texts(app)[0].startswith("notes.md")
        await pilot.press("ctrl+a", "ctrl+k")  # (the box's own editing keys)
        await pilot.press(*"what does it say?")
        # another session has its own (empty) box; coming back brings the chip back
        await pilot.press("alt+2")
        assert not chip_texts(app) and not app.chat.attachment_chips.display
        await pilot.press("alt+1")
        await wait_until(pilot, lambda: len(chip_texts(app)) == 1, what="the chip again")
        assert app.chat.composer.text == "what does it say?"
    again, engine = fake_app(store=Store(path), manual=True, tokens_per_reply=4)
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot, again)
        await pilot.press("alt+1")
        await wait_until(pilot, lambda: len(chip_texts(again)) == 1, what="kept by the quit")
        await wait_until(
            pilot, lambda: "tokens" in chip_texts(again)[0], what="counted after the restart"
        )
        assert again.chat.composer.text == "what does it say?"
        await pilot.press("enter")
        await wait_until(pilot, lambda: again.service.messages(first), what="sent")
        sent = again.service.messages(first)[0].content
        assert sent.startswith("File `notes.md`:") and "the cache keeps pages" in sent
        assert sent.endswith("what does it say?") and "chapter one" not in sent
        assert not chip_texts(again) and again.chat.composer.text == ""
        engine.advance(10)
        await wait_until(
            pilot, lambda: again.service.session(first).state == "idle", what="the reply"
        )
        await pilot.press("f3")  # edit and resend: the file is a chip again
        await wait_until(pilot, lambda: len(chip_texts(again)) == 1, what="the chip on edit")
        assert again.chat.composer.text == "what does it say?"
        chip = again.chat.query_one(AttachmentChip)
        await pilot.click(chip)  # the click removes it
        await wait_until(pilot, lambda: not chip_texts(again), what="no chip")
        await pilot.press("enter")
        await wait_until(
            pilot,
            lambda: (
                [m.content for m in again.service.messages(first) if m.role == "user"]
                == ["what does it say?"]
            ),
            what="resent without the file",
        )
        assert again.service.messages(second) == []
