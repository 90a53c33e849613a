"""The message input: a multi-line text area; enter sends, shift+enter / ctrl+j break the line.

Why the keys are handled in `_on_key` and not as priority bindings: a `TextArea`
consumes enter itself (it inserts a newline), and a priority binding runs on
the App as soon as the key arrives, before the characters typed just before it
have reached the text area (in a real terminal, "hello" + enter sent "hel").
Handling send in the widget's own key handler keeps the keys in order. The
bindings still exist, with ids, for the footer and for remapping: the keys
come from the settings' keymap.

The message is the attached files (shown as chips beside the box) and then the typed
text: `message` joins them, `load_message` splits a stored or edited one back.
"""

from __future__ import annotations

from collections.abc import Mapping

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from kvchat.chat.attachments import Attachment, message_with, split_message
from kvchat.tui.keys import COMPOSER_KEYS, bindings, keys_for


class Composer(TextArea):
    """Posts `Composer.Submitted` with the message on send; the app clears it."""

    BINDINGS = bindings(COMPOSER_KEYS)

    class Submitted(Message):
        def __init__(self, composer: Composer, text: str) -> None:
            super().__init__()
            self.composer = composer
            self.text = text

    class AttachmentsChanged(Message):
        """The attachments changed (the typed text did not: that is `TextArea.Changed`)."""

        def __init__(self, composer: Composer) -> None:
            super().__init__()
            self.composer = composer

    def __init__(self, *, keymap: Mapping[str, str] | None = None, id: str | None = None) -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus")
        self.editing = False  # True: the next send replaces the last user message
        self.attachments: tuple[Attachment, ...] = ()
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
        elif event.key == "backspace" and self.attachments and self._at_start():
            event.stop()
            event.prevent_default()
            self.detach(len(self.attachments) - 1)
        else:
            await super()._on_key(event)

    def action_send(self) -> None:
        message = self.message.strip()
        if not message:
            return
        self.post_message(self.Submitted(self, message))

    @property
    def message(self) -> str:
        """What a send would send: the attachments' blocks, then the typed text."""
        return message_with(self.attachments, self.text)

    def load_message(self, message: str) -> None:
        """Show `message`: its attachments as chips, the rest as text."""
        attachments, text = split_message(message)
        self._set_attachments(attachments)
        self.load_text(text)

    def attach(self, attachment: Attachment) -> None:
        self._set_attachments((*self.attachments, attachment))

    def detach(self, index: int) -> None:
        if 0 <= index < len(self.attachments):
            self._set_attachments(self.attachments[:index] + self.attachments[index + 1 :])

    def clear(self):  # type: ignore[no-untyped-def]  # TextArea's EditResult
        """Empty the box and drop its attachments."""
        self._set_attachments(())
        return super().clear()

    def _set_attachments(self, attachments: tuple[Attachment, ...]) -> None:
        if attachments != self.attachments:
            self.attachments = attachments
            self.post_message(self.AttachmentsChanged(self))

    def _at_start(self) -> bool:
        selection = self.selection
        return selection.start == selection.end == (0, 0)

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
