"""Reply text buffered per session between the service's worker thread and the UI's timer.

Why a buffer: a token is a few characters and eight sessions stream at once;
repainting the transcript for each one would spend the UI's time on Markdown
parsing and starve the keys. The service's worker thread only appends here (a
lock, no widget); the UI drains the visible session's text 20 times a second and
discards hidden sessions' text (a switch renders the session from the service's
snapshot anyway). Each chunk carries its character offset in the reply, so a
transcript rendered from a snapshot that already holds some of the pending text
skips exactly that part: no character is shown twice or lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvchat.rate_window import RateWindow

RATE_WINDOW_S = 2.0


@dataclass(frozen=True)
class Chunk:
    message_id: str
    start: int  # characters of this reply before `text`
    text: str


@dataclass
class _Reply:
    session_id: str
    received: int = 0  # characters received so far
    pending_start: int = 0
    pending: list[str] = field(default_factory=list)


class StreamBuffer:
    """Thread-safe: `add` from any thread, the rest from the UI thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replies: dict[str, _Reply] = {}  # message id -> its reply
        self._token_rates: dict[str, RateWindow] = {}  # session -> its tokens' arrivals

    def add(self, session_id: str, message_id: str, text: str, tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            reply = self._replies.get(message_id)
            if reply is None:
                reply = self._replies[message_id] = _Reply(session_id)
            if not reply.pending:
                reply.pending_start = reply.received
            reply.pending.append(text)
            reply.received += len(text)
            rates = self._token_rates.get(session_id)
            if rates is None:
                rates = self._token_rates[session_id] = RateWindow(RATE_WINDOW_S)
            rates.add(now, tokens)

    def take(self, session_id: str) -> list[Chunk]:
        """The pending text of `session_id`'s replies (cleared); other sessions' is dropped."""
        out: list[Chunk] = []
        with self._lock:
            for message_id, reply in self._replies.items():
                if reply.pending and reply.session_id == session_id:
                    out.append(Chunk(message_id, reply.pending_start, "".join(reply.pending)))
                reply.pending = []
        return out

    def finish(self, message_id: str) -> None:
        """The reply ended (after its final flush): forget it."""
        with self._lock:
            self._replies.pop(message_id, None)

    def session_rate(self, session_id: str) -> float | None:
        """Tokens per second this session received over the last couple of seconds."""
        with self._lock:
            rates = self._token_rates.get(session_id)
            return rates.rate(time.monotonic()) if rates is not None else None
