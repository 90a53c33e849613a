"""Each session's own composer text: stored with the session it was typed for.

Why: text typed for one conversation must never be sent to another, and it must
survive a switch, a restart or a crash (docs/tui.md, "A composer text per session").
It is stored from the UI thread, in typing order, so a late store can never bring
back a message already sent (`say` clears it).
"""

from __future__ import annotations

import contextlib

from kvchat.chat.service import SessionService
from kvchat.errors import KvchatError
from kvchat.tui.composer import Composer


class UnsentText:
    """Stores the composer's text with a session, and reads a session's back."""

    def __init__(self, service: SessionService, composer: Composer) -> None:
        self.service = service
        self.composer = composer

    def keep(self, session_id: str | None) -> None:
        """Store the composer's text as `session_id`'s unsent text (not while it holds a
        message being edited: that one is still stored as sent)."""
        if session_id is None or self.composer.editing:
            return
        with contextlib.suppress(KvchatError):  # deleted meanwhile
            self.service.keep_unsent(session_id, self.composer.message)

    def of(self, session_id: str | None) -> str:
        """`session_id`'s stored unsent text ("" for none, or for a session gone)."""
        if session_id is None:
            return ""
        try:
            return self.service.session(session_id).unsent
        except KvchatError:
            return ""
