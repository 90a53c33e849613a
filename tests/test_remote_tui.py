"""What the TUI shows for a session on a remote server, where no residency exists."""

from __future__ import annotations

from kvchat.chat.session import SessionView, TurnState, TurnStats
from kvchat.engine.api import CachedTokens, Residency
from kvchat.tui.sidebar import row_content
from tests.tui_helpers import session_view


def _view(cached: int | None) -> SessionView:
    last = TurnStats("stop", 600, CachedTokens(cached, None, None), None, None, 8, 0.2, 30.0)
    return session_view(
        id="s", title="doc", state=TurnState.IDLE, message_count=4, context_tokens=620,
        context_length=8192, last_turn=last, max_tokens=512,
        model_fingerprint="remote:vllm:smollm2",
    )  # fmt: skip


def test_the_sidebar_shows_the_last_hit_rate_where_no_residency_can_be_drawn() -> None:
    text = row_content(1, _view(492), Residency(0, 0, 0)).plain
    assert "last hit 82%" in text
    # a server that does not report cached tokens: nothing made up, the plain dots
    unreported = row_content(1, _view(None), Residency(0, 0, 0)).plain
    assert "last hit" not in unreported and "····" in unreported
    # where residency is known, the bar as before
    assert "last hit" not in row_content(1, _view(492), Residency(400, 0, nowhere=220)).plain
