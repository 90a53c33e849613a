"""The message input: a multi-line text area; enter sends, shift+enter / ctrl+j break the line.

Why the keys are handled in `_on_key` and not as priority bindings: a `TextArea`
consumes enter itself (it inserts a newline), and a priority binding runs on
the App as soon as the key arrives, before the characters typed just before it
have reached the text area (in a real terminal, "hello" + enter sent "hel").
Handling send in the widget's own key handler keeps the keys in order. The
bindings still exist, with ids, for the footer and for remapping: the keys
come from the settings' keymap.
"""

from __future__ import annotations

from collections.abc import Mapping

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from kvchat.tui.keys import COMPOSER_KEYS, bindings, keys_for


class Composer(TextArea):
    """Posts `Composer.Submitted` with the text on send; clears itself."""

    BINDINGS = bindings(COMPOSER_KEYS)

    class Submitted(Message):
        def __init__(self, composer: Composer, text: str) -> None:
            super().__init__()
            self.composer = composer
            self.text = text

    def __init__(self, *, keymap: Mapping[str, str] | None = None, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self.editing = False  # True: the next send replaces the last user message
        keymap = keymap or {}
        self.send_keys = _key_set(keys_for("send", keymap))
        self.newline_keys = _key_set(keys_for("newline", keymap))

    async def _on_key(self, event: events.Key) -> None:
        names = {event.key, *event.aliases}
        if names & self.send_keys:
            event.stop()
            event.prevent_default()
            self.action_send()
        elif names & self.newline_keys:
            event.stop()
            event.prevent_default()
            self.action_newline()
        else:
            await super()._on_key(event)

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


def _key_set(keys: str) -> set[str]:
    return {k.strip() for k in keys.split(",") if k.strip()}
