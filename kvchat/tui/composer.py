"""The message input: a multi-line text area where enter sends and shift+enter / ctrl+j break the line.

Why priority bindings: a `TextArea` consumes enter itself (it inserts a newline)
before ordinary bindings are looked at; binding send and newline with priority,
and with ids, keeps both remappable from the settings file.
"""

from __future__ import annotations

from textual.message import Message
from textual.widgets import TextArea

from kvchat.tui.keys import COMPOSER_KEYS, bindings


class Composer(TextArea):
    """Posts `Composer.Submitted` with the text on send; clears itself."""

    BINDINGS = bindings(COMPOSER_KEYS, priority=True)

    class Submitted(Message):
        def __init__(self, composer: Composer, text: str) -> None:
            super().__init__()
            self.composer = composer
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self.editing = False  # True: the next send replaces the last user message

    def action_send(self) -> None:
        text = self.text.strip()
        if not text:
            return
        self.post_message(self.Submitted(self, text))

    def action_newline(self) -> None:
        self.insert("\n")

    def set_editing(self, editing: bool) -> None:
        self.editing = editing
        self.set_class(editing, "-editing")
        self.border_title = (
            "Editing your last message: send replaces it (esc cancels)" if editing else None
        )
