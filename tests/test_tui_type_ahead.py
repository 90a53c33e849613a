"""The composer's text is computed ahead (type-ahead), and its border says how much is ready."""

from __future__ import annotations

from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until
from kvchat.tui.type_ahead import TypeAheadTimer, ready_label

SIZE = (150, 45)
PASTE = "def double(x):\n    return x * 2\n" * 20


def test_a_type_ahead_is_due_after_a_pause_or_after_many_new_characters() -> None:
    timer = TypeAheadTimer(pause_s=0.3, every_chars=256)
    assert not timer.due(0.0, 10)  # nothing edited
    timer.edited(1.0)
    assert not timer.due(1.1, 10)  # still typing
    assert timer.due(1.3, 10)  # paused
    assert not timer.pending
    due = []
    for i in range(10):  # 40 characters every 0.1 s, never a pause
        timer.edited(2.0 + i * 0.1)
        if timer.due(2.0 + i * 0.1, 10 + (i + 1) * 40):
            due.append(10 + (i + 1) * 40)
    assert due == [290]  # 280 new characters since the last type-ahead (of 10)
    assert timer.pending  # still typing: the pause will send the rest
    timer.reset()
    assert not timer.pending and not timer.due(9.0, 1000)


def test_the_ready_label() -> None:
    assert ready_label(0, 0) is None
    assert ready_label(2940, 2940) == "2,940 tokens ready"


async def test_a_paste_is_computed_ahead_and_the_border_fills_then_send_ends_it():
    app, engine = fake_app(manual=True, tokens_per_reply=3)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current is not None, what="a session")
        app.chat.composer.insert(PASTE)
        await wait_until(
            pilot, lambda: len(engine.type_aheads) == 1, what="the paste is computed ahead"
        )
        await wait_until(
            pilot,
            lambda: app.chat.composer.border_subtitle == "0 tokens ready",
            what="the border shows the type-ahead, nothing computed yet",
        )
        engine.advance(1)  # the fake engine computes the type-ahead whole in one step
        total = len(engine.type_aheads[0])
        await wait_until(
            pilot,
            lambda: app.chat.composer.border_subtitle == f"{total:,} tokens ready",
            what="the border shows the type-ahead ready",
        )
        await pilot.press(*"Why?")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(engine.submitted) == 1, what="the message is sent")
        assert engine.submitted[0].prompt_ids[:total] == engine.type_aheads[-1][:total]
        await wait_until(
            pilot,
            lambda: app.chat.composer.border_subtitle is None,
            what="the type-ahead indicator clears",
        )
        engine.advance(10)


async def test_switching_away_cancels_the_type_ahead_and_the_text_stays_with_its_session():
    app, engine = fake_app(manual=True)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await new_sessions(pilot, app, 2)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 2, what="two sessions")
        first = app.chat.current
        app.chat.composer.insert("a question being typed")
        await wait_until(pilot, lambda: len(engine.type_aheads) == 1, what="computed ahead")
        await pilot.press("alt+down")
        await wait_until(pilot, lambda: app.chat.current != first, what="switched")
        await wait_until(pilot, lambda: engine.cancelled_ids, what="the type-ahead is cancelled")
        assert app.chat.composer.text == ""  # the other session's box: its own, empty
        await pilot.press("alt+up")
        await wait_until(pilot, lambda: app.chat.current == first, what="back")
        assert app.chat.composer.text == "a question being typed"
        await wait_until(pilot, lambda: len(engine.type_aheads) == 2, what="computed ahead again")
        assert engine.type_aheads[0] == engine.type_aheads[1]  # the same text into the same session
