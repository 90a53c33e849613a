"""Helpers for the TUI tests: what the app shows (the app itself: `kvchat.testing.tui`)."""

from __future__ import annotations

from kvchat.chat.session import SessionView, TurnState
from kvchat.engine.request import SamplingParams
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


def session_view(**changes) -> SessionView:
    """A session's view as the sidebar gets it, with `changes`: for widget tests that
    need no service."""
    values = dict(
        id="s1",
        title="chat",
        state=TurnState.DECODING,
        archived=False,
        unread=False,
        queued_says=0,
        message_count=2,
        context_tokens=100,
        context_length=4096,
        last_turn=None,
        system_prompt=None,
        sampling=SamplingParams(),
        max_tokens=64,
        model_fingerprint="m",
        notice=None,
        created=0.0,
        updated=0.0,
        number=1,
        unsent="",
    )
    values.update(changes)
    return SessionView(**values)
