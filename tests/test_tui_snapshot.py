"""Snapshot-like checks of the main layout in two themes (SVG screenshots, deterministic).

pytest-textual-snapshot is not a dependency; instead the app's own SVG export
is checked for its structure (sidebar, transcript, meter labels, footer keys)
and for the theme's colors, so a layout or theme regression fails here.
"""

from __future__ import annotations

import pytest

from kvchat.chat.settings import Settings
from kvchat.testing.tui import fake_app, ready, wait_until
from tests.tui_helpers import transcript_texts

LABELS = ("Sessions", "Hit rate", "Pages", "Evictions", "TTFT", "Decode tok/s", "Cache")


def _svg_text(svg: str) -> str:
    """The SVG's visible text, with the non-breaking spaces Textual writes made plain."""
    return svg.replace("&#160;", " ").replace("\u00a0", " ")


@pytest.mark.parametrize(
    ("theme", "background", "primary"),
    [("kvchat-dark", "#0f1419", "#4ea1ff"), ("kvchat-light", "#f7f7f5", "#0b62c4")],
)
async def test_main_layout_in_theme(theme, background, primary):
    app, _ = fake_app(settings=Settings(theme=theme), tokens_per_reply=6)
    async with app.run_test(size=(150, 40)) as pilot:
        await ready(pilot, app)
        assert app.theme == theme
        await pilot.press(*"layout check", "enter")
        await wait_until(
            pilot,
            lambda: transcript_texts(app)[-1:] != [] and transcript_texts(app)[-1][1] == "complete",
        )
        await pilot.pause()
        svg = app.export_screenshot()
    text = _svg_text(svg)
    for label in LABELS:
        assert label in text, label
    assert "layout check" in text  # the session's title in the sidebar and the message
    assert "Assistant" in text and "You" in text
    assert "Send" in text and "Quit" in text  # the footer's keys
    assert background in svg.lower()
    assert primary in svg.lower()
