"""Finding a conversation again: the sessions whose title or messages hold a query.

Why a plain case-insensitive substring and not a fuzzy match over messages: a fuzzy
matcher finds "the cache" in any long reply that has those letters in order, so every
session matches a short query. Titles are short, and the palette's own fuzzy matcher
scores them; messages need the words as typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvchat.chat.session import Session

SNIPPET_CHARS = 60  # of context around a match in a message, both sides together


@dataclass(frozen=True)
class SearchHit:
    """One place a query was found: a session's title (`message_id` None) or a message."""

    session_id: str
    number: int
    title: str
    message_id: str | None
    role: str | None
    snippet: str  # the match with some text around it, on one line


def search_sessions(sessions: Iterable[Session], query: str, *, limit: int) -> list[SearchHit]:
    """Title hits first (in the order given), then message hits, newest message first in
    each session; at most one hit per message and `limit` in all."""
    needle = query.strip().casefold()
    if not needle:
        return []
    sessions = list(sessions)
    titles = [
        SearchHit(s.id, s.number, s.title, None, None, s.title)
        for s in sessions
        if needle in s.title.casefold()
    ]
    found = titles[:limit]
    for session in sessions:
        for message in reversed(session.messages):
            if len(found) >= limit:
                return found
            at = message.content.casefold().find(needle)
            if at >= 0:
                snippet = _snippet(message.content, at, len(needle))
                found.append(
                    SearchHit(
                        session.id, session.number, session.title, message.id, message.role,
                        snippet,
                    )
                )  # fmt: skip
    return found


def _snippet(text: str, at: int, length: int) -> str:
    room = max(0, SNIPPET_CHARS - length) // 2
    start, end = max(0, at - room), min(len(text), at + length + room)
    piece = " ".join(text[start:end].split())
    return ("…" if start else "") + piece + ("…" if end < len(text) else "")
