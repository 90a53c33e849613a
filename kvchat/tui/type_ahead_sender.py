"""The composer's text as the shown session's type-ahead, and the border that says how much
is ready.

The engine computes the text while the user types (type-ahead prefill), so that enter
finds the message's pages mostly cached; `TypeAheadTimer` decides when the text is due.
Rendering and tokenizing a pasted document takes milliseconds, so the text is sent
from a thread worker. The "N tokens ready" label is set when the service says so and
shown at the frame pump's next tick: a type-ahead beside streams moves every step, and each
change of the border repaints the text area.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from textual.dom import DOMNode

from kvchat.chat.service import SessionService
from kvchat.errors import KvchatError
from kvchat.tui.composer import Composer
from kvchat.tui.type_ahead import TypeAheadTimer
from kvchat.tui.unsent_text import UnsentText


class TypeAheadSender:
    """Sends the composer's text ahead when due; keeps the ready label for the next tick."""

    def __init__(
        self, service: SessionService, composer: Composer, unsent: UnsentText, workers: DOMNode
    ) -> None:
        self.service = service
        self.composer = composer
        self.unsent = unsent
        self.workers = workers  # runs the thread workers
        self.timer = TypeAheadTimer()  # when the composer's text is computed ahead
        self.label: str | None = None  # the composer's "N tokens ready", shown at a tick
        self._label_shown: str | None = None  # (the border keeps it as Content, not str)

    def edited(self) -> None:
        """The composer's text changed (or now belongs to another session)."""
        self.timer.edited(time.monotonic())

    def sent(self) -> None:
        """The text was sent: nothing is due until the next edit."""
        self.timer.reset()

    def leave(self, session_id: str) -> None:
        """The session is no longer shown: its type-ahead ends (its pages stay cached)."""
        self._in_thread(lambda: self.service.end_type_ahead(session_id))
        self.label = None
        self.timer.reset()

    def tick(self, current: str | None) -> None:
        """At the frame pump's tick: send the text ahead if due, show the label if it changed."""
        if self.timer.pending:
            self._send_if_due(current)
        if self._label_shown != self.label:  # "N tokens ready"
            self.composer.border_subtitle = self._label_shown = self.label

    def _send_if_due(self, current: str | None) -> None:
        """The composer's text as the current session's type-ahead, once typing paused (or grew)."""
        if current is None or self.composer.editing:
            return
        text = self.composer.message
        if self.timer.due(time.monotonic(), len(text)):
            self.unsent.keep(current)  # here, in typing order: never after a send
            typed = text.strip()
            self._in_thread(lambda: self.service.type_ahead(current, typed))

    def _in_thread(self, call: Callable[[], None]) -> None:
        def run() -> None:
            with contextlib.suppress(KvchatError):  # deleted meanwhile
                call()

        self.workers.run_worker(run, thread=True, exit_on_error=False, group="type-ahead")
