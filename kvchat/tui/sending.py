"""Sending the composer's message: one thread, in send order, never the UI thread.

Why a thread: sizing a turn may ask a server (`/tokenize` on a remote engine), and
the UI never waits on the engine. One thread keeps the messages in the order they
were sent. A refusal is posted back as `SendFailed`, so that the text returns to the
composer to be fixed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from textual.message_pump import MessagePump

from kvchat.chat.service import SessionService
from kvchat.tui.guarded import log_failure
from kvchat.tui.messages import SendFailed

NEW_TITLE = "New chat"


class Sender:
    """Says (or edits and resends) what the composer sent, on its own thread."""

    def __init__(self, service: SessionService, replies_to: MessagePump) -> None:
        self.service = service
        self.replies_to = replies_to  # gets `SendFailed`
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-send")

    def send(self, session_id: str, text: str, *, editing: bool, retitle: bool) -> None:
        """Queue `text` for `session_id`; `retitle` names a "New chat" after it."""
        self._pool.submit(self._send, session_id, text, editing, retitle)

    def close(self) -> None:
        """Wait for what was sent: a message sent just before quitting is stored."""
        self._pool.shutdown(wait=True)

    def _send(self, session_id: str, text: str, editing: bool, retitle: bool) -> None:
        """Sender thread: say `text` (or edit and resend); a refusal gives the text back."""
        try:
            if editing:
                self.service.edit_last_user_message(session_id, text)
            else:
                self.service.say(session_id, text)  # ends the session's draft, keeping its pages
                if retitle:
                    self.service.rename(session_id, title_from(text))
        except Exception as exc:
            log_failure(exc, "send")
            # posted, not called: `close` may be waiting for this thread on the UI thread
            self.replies_to.post_message(SendFailed(text, editing, exc))


def title_from(text: str) -> str:
    """A new session's title: the first line of its first message, cut at 32 characters."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), NEW_TITLE)
    return first if len(first) <= 32 else first[:31] + "…"
