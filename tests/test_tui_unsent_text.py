"""Each session has its own composer text: typed in one, it stays with that one across
switches and restarts, and is never sent to another."""

from __future__ import annotations

from kvchat.chat.store import Store
from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until

SIZE = (150, 45)


async def test_typed_text_stays_with_its_session_across_switches_and_a_restart(tmp_path):
    path = tmp_path / "sessions.db"
    app, _ = fake_app(store=Store(path))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await new_sessions(pilot, app, 2)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 2, what="two rows")
        first, second = app.chat.sidebar.order
        await pilot.press("alt+1")
        await pilot.press(*"for one")
        await pilot.press("alt+2")
        assert app.chat.current == second and app.chat.composer.text == ""  # not the other's text
        await pilot.press(*"for two")
        await pilot.press("alt+1")
        assert app.chat.composer.text == "for one"
        await pilot.press("alt+2")
        assert app.chat.composer.text == "for two"
        await pilot.press("enter")  # sent to the second session only
        await wait_until(pilot, lambda: app.service.messages(second), what="the message")
        said = [m.content for m in app.service.messages(second) if m.role == "user"]
        assert said == ["for two"]
        assert app.service.messages(first) == []
        await pilot.press("alt+1")
        await pilot.press(*" more")
    again, _ = fake_app(store=Store(path))
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot, again)
        await pilot.press("alt+1")
        assert again.chat.composer.text == "for one more"  # kept by the quit
        await pilot.press("alt+2")
        assert again.chat.composer.text == ""  # sent, so nothing is left to restore
