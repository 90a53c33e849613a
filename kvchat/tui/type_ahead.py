"""When the composer's text is computed ahead (type-ahead prefill), and how its border says so.

The engine computes the text while the user is still typing, so that Enter finds the
message's pages mostly cached. Sending one at every keystroke would re-render and
re-tokenize the whole text (a pasted document included) many times a second, so the
text is sent once typing pauses (`PAUSE_S`), and while typing goes on without a
pause every `EVERY_CHARS` characters (about 64 tokens). The session layer replaces
a session's previous type-ahead, so at most one is in flight per session.
"""

from __future__ import annotations

PAUSE_S = 0.3
EVERY_CHARS = 256  # about 64 tokens of English prose or code, at ~4 characters a token


class TypeAheadTimer:
    """Decides, from the composer's edits, when its text is due to be computed ahead."""

    def __init__(self, pause_s: float = PAUSE_S, every_chars: int = EVERY_CHARS) -> None:
        self.pause_s = pause_s
        self.every_chars = every_chars
        self._edited_at: float | None = None  # None: nothing new since the last was sent
        self._sent_chars = 0

    @property
    def pending(self) -> bool:
        """Edits not sent yet (cheap: the app asks at every tick)."""
        return self._edited_at is not None

    def edited(self, now: float) -> None:
        """The composer's text changed (or now belongs to another session)."""
        self._edited_at = now

    def reset(self) -> None:
        """The text was sent or cleared: nothing is due until the next edit."""
        self._edited_at = None
        self._sent_chars = 0

    def due(self, now: float, chars: int) -> bool:
        """Whether the text (`chars` long) should be sent now; if so it counts as sent."""
        if self._edited_at is None:
            return False
        paused = now - self._edited_at >= self.pause_s
        grew = chars - self._sent_chars >= self.every_chars
        if not (paused or grew):
            return False
        self._sent_chars = chars
        if paused:
            self._edited_at = None
        return True


def ready_label(ready: int, total: int) -> str | None:
    """The composer's border subtitle for a type-ahead: "2,940 tokens ready"; None without one."""
    if total <= 0:
        return None
    return f"{ready:,} tokens ready"
