"""Search across sessions: the service finds titles and messages; the palette lists them
and opens the session at the message found."""

from __future__ import annotations

from textual.command import CommandList, CommandPalette

from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.testing.fake_engine import CharRenderer, FakeEngine
from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until

SIZE = (150, 45)


def say_and_wait(service: SessionService, sid: str, text: str) -> None:
    service.say(sid, text)
    assert service.wait_idle(sid, timeout=10)


def test_titles_then_messages_newest_first_case_and_spacing_ignored() -> None:
    engine, renderer = FakeEngine(), CharRenderer()
    service = SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )
    try:
        older = service.create_session()
        newer = service.create_session()
        service.rename(older, "Page table notes")
        say_and_wait(service, older, "How does the PAGE table\nwork?")
        say_and_wait(service, newer, "nothing here")
        say_and_wait(service, newer, "a page of text")
        hits = service.search("page")
        assert hits[0].message_id is None and hits[0].title == "Page table notes"
        in_messages = [(h.session_id, h.role, h.snippet) for h in hits[1:] if h.role == "user"]
        assert in_messages == [
            (newer, "user", "a page of text"),
            (older, "user", "How does the PAGE table work?"),  # one line
        ]
        assert service.search("  ") == [] and service.search("absent") == []
        assert len(service.search("page", limit=2)) == 2
        service.set_archived(older, True)
        assert all(h.session_id == newer for h in service.search("page"))
        assert any(h.session_id == older for h in service.search("page", include_archived=True))
    finally:
        service.close()
        engine.close()


def palette_options(app) -> list[str]:
    if not isinstance(app.screen, CommandPalette):
        return []
    options = app.screen.query_one(CommandList)
    return [
        getattr(p, "plain", str(p)).splitlines()[0]
        for p in (options.get_option_at_index(i).prompt for i in range(options.option_count))
    ]


async def test_the_palette_finds_a_message_in_another_session_and_opens_it(tmp_path):
    app, _ = fake_app(manual=False, tokens_per_reply=3)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await new_sessions(pilot, app, 2)
        first, _ = app.chat.sidebar.order
        await pilot.press("alt+1")
        await pilot.press(*"where is the zebra crossing", "enter")
        await wait_until(
            pilot, lambda: app.service.session(first).state == "idle" and
            app.service.messages(first), what="the first turn",
        )  # fmt: skip
        app.service.rename(first, "Animals")  # (the send titled it with the message)
        await pilot.press("alt+2")
        await pilot.press("ctrl+p")
        await pilot.press(*"zebra")
        await wait_until(
            pilot,
            lambda: any(o.startswith("In 1.") for o in palette_options(app)),
            what="the hit",
        )
        hit = next(o for o in palette_options(app) if o.startswith("In 1."))
        await wait_until(pilot, lambda: palette_options(app)[0] == hit, what="the hit first")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat.current == first, what="the session opened")
        assert not app.chat.transcript.following  # scrolled to the message, not to the end
