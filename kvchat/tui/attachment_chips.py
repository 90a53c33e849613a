"""The files attached to the message being written, as one-line chips above the composer.

Why chips and not the file's text in the box: a pasted document pushed the question off
the composer and the only way to drop it was to select and delete pages of text. A chip
shows the name and the token count at once; clicking its × or backspace at the start of
the box removes it (the composer handles the key).
"""

from __future__ import annotations

from collections.abc import Mapping

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from kvchat.chat.attachments import Attachment


class AttachmentChip(Static):
    """One attachment: `name · N tokens ×`; a click removes it."""

    def __init__(self, index: int, attachment: Attachment, tokens: int | None) -> None:
        size = f"{tokens:,} tokens" if tokens is not None else "counting…"
        super().__init__(f"{attachment.name} · {size} ×", classes="attachment-chip")
        self.index = index
        self.tooltip = "click to remove it (or backspace at the start of the box)"

    def on_click(self) -> None:
        self.post_message(AttachmentChips.RemoveRequested(self.index))


class AttachmentChips(Horizontal):
    """The chips of the composer's attachments; hidden while there are none."""

    class RemoveRequested(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.display = False
        self.attachments: tuple[Attachment, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static("backspace at the start of the box removes the last", classes="chips-hint")

    async def show(self, attachments: tuple[Attachment, ...], tokens: Mapping[str, int]) -> None:
        """Draw `attachments`, each with its token count once known (keyed by block)."""
        self.attachments = attachments
        await self.query(AttachmentChip).remove()
        chips = [AttachmentChip(i, a, tokens.get(a.block)) for i, a in enumerate(attachments)]
        if chips:
            await self.mount_all(chips, before=0)
        self.display = bool(attachments)
