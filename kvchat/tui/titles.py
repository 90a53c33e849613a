"""A new session's title, and the title it gets from its first message."""

from __future__ import annotations

NEW_TITLE = "New chat"


def title_from(text: str) -> str:
    """A new session's title: the first line of its first message, cut at 32 characters."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), NEW_TITLE)
    return first if len(first) <= 32 else first[:31] + "…"
