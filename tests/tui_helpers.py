"""Helpers for the TUI tests: what the app shows (the app itself: `kvchat.testing.tui`)."""

from __future__ import annotations

from kvchat.tui.app import KvchatApp
from kvchat.tui.transcript import MessageBlock


def transcript_texts(app: KvchatApp) -> list[tuple[str, str, str]]:
    """(role, state, text shown) for each rendered message of the current session."""
    return [
        (b.message.role, str(b.message.state), b.body.source)
        for b in app.chat.transcript.query(MessageBlock)
    ]


def row_views(app: KvchatApp) -> dict[str, object]:
    return {sid: row.view for sid, row in app.chat.sidebar.rows().items()}
