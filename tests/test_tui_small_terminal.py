"""At 100x30, where the meters give their room to the transcript: the footer's keys all
fit, a key brings the meters back, notices leave the composer readable, and help
scrolls to its last line."""

from __future__ import annotations

from textual.widgets import Footer
from textual.widgets._footer import FooterKey

from kvchat.testing.tui import fake_app, ready, wait_until
from kvchat.tui.screens import HelpScreen

SMALL = (100, 30)
WIDE = (150, 45)


async def test_every_footer_key_fits_in_100_columns() -> None:
    app, _ = fake_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat.current is not None, what="a session")
        keys = list(app.chat.query_one(Footer).query(FooterKey))
        assert len(keys) >= 8
        # the meters' key too: at this width they give their room to the transcript
        assert "Meters" in [key.description for key in keys]
        assert all(key.region.x >= 0 and key.region.right <= SMALL[0] for key in keys), [
            (key.description, key.region) for key in keys
        ]
        assert all(key.region.width > 0 for key in keys)


async def test_the_meters_key_shows_them_on_a_small_screen_and_hides_them_on_a_wide_one() -> None:
    app, _ = fake_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        assert not app.chat.meters.display or app.chat.meters.region.width == 0
        await pilot.press("f7")
        await wait_until(pilot, lambda: app.chat.meters.region.width > 0, what="the meters shown")
        assert app.chat.sidebar.region.width == 0  # in the sidebar's place
        assert app.chat.transcript.region.width >= 60
        await pilot.press("f7")
        await wait_until(pilot, lambda: app.chat.sidebar.region.width > 0, what="the sidebar back")
        assert app.chat.meters.region.width == 0
    app, _ = fake_app()
    async with app.run_test(size=WIDE) as pilot:
        await ready(pilot, app)
        assert app.chat.meters.region.width > 0
        await pilot.press("f7")
        await wait_until(pilot, lambda: app.chat.meters.region.width == 0, what="the meters hidden")
        assert app.chat.sidebar.region.width > 0


async def test_a_notice_does_not_cover_the_composer() -> None:
    app, _ = fake_app()
    async with app.run_test(size=SMALL, notifications=True) as pilot:
        await ready(pilot, app)
        app.notify("A notice long enough to need a few lines of the toast's width, at least")
        toasts = []

        def shown() -> bool:
            toasts[:] = [w for w in app.screen.query("Toast") if w.region.height > 0]
            return bool(toasts)

        await wait_until(pilot, shown, what="the notice")
        composer = app.chat.composer.region
        assert all(not toast.region.overlaps(composer) for toast in toasts), (
            [t.region for t in toasts],
            composer,
        )


async def test_help_scrolls_to_its_last_line_on_a_small_screen() -> None:
    app, _ = fake_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        scroll = app.screen.query_one("#help")
        await wait_until(pilot, lambda: scroll.max_scroll_y > 0, what="help laid out")
        assert scroll.show_vertical_scrollbar  # there is more below, and it shows
        assert app.focused is scroll  # the page keys scroll it at once
        await pilot.press("end")
        await wait_until(pilot, lambda: scroll.scroll_y == scroll.max_scroll_y, what="the end")


async def test_the_first_run_hint_wraps_and_the_legend_fits_the_sidebar() -> None:
    """At 100 columns the transcript is narrower than the hint a first start shows: it
    wraps instead of losing its end; the sidebar's legend fits its border whole."""
    from textual.widgets import Label

    from kvchat.tui.sidebar import LEGEND

    app, _ = fake_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        hints = [w for w in app.chat.transcript.query(Label) if w.has_class("empty")]
        assert hints
        for hint in hints:
            assert hint.region.right <= app.chat.transcript.region.right
            text = str(hint.render())
            assert hint.region.width * hint.region.height >= len(text), (text, hint.region)
        # "╰─ " + legend + " ─╯" within the sidebar's width
        assert len(LEGEND) + 6 <= app.chat.sidebar.region.width
