"""Attaching a file's text to the composer's message, and the chips that show each file.

Each chip shows the tokens its file adds; the count of a file attached now is taken at
once (the message's size against what a prompt holds is said then), the counts of
chips that come back with a stored message in a thread worker (tokenizing a long file
takes a while).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from textual.widget import Widget

from kvchat.chat.attachments import Attachment, attach
from kvchat.chat.service import SessionService
from kvchat.errors import KvchatError
from kvchat.tui.attachment_chips import AttachmentChips
from kvchat.tui.composer import Composer


class Attachments:
    """Attaches files to the composer's message and keeps their chips' token counts."""

    def __init__(
        self,
        service: SessionService,
        *,
        composer: Composer,
        chips: AttachmentChips,
        current: Callable[[], str | None],
        host: Widget,
    ) -> None:
        self.service = service
        self.composer = composer
        self.chips = chips
        self.current = current  # the session shown
        self.host = host  # runs the thread workers, shows the notices
        self._tokens: dict[str, int] = {}  # by block: a chip's count, once known

    def attach_file(self, path: Path) -> None:
        """Attach `path`'s text (a `KvchatError` says why it cannot be) and say the size."""
        attachment = attach(path)
        composer = self.composer
        composer.attach(attachment)
        composer.focus()
        current = self.current()
        if current is None:
            self.host.notify(f"Attached {path.name}; type your question and press enter.")
            return
        self._tokens[attachment.block] = self._tokens_of(current, attachment)
        tokens, room = self.service.message_size(current, composer.message)
        if tokens > room:
            self.host.notify(
                f"Attached {path.name}: the message is now {tokens:,} tokens, "
                f"{tokens - room:,} more than a prompt can hold ({room:,}: the model's "
                "context less the reply's room). Cut the file's text before sending.",
                severity="warning",
                timeout=15,
            )
        else:
            self.host.notify(
                f"Attached {path.name}: the message is {tokens:,} tokens of the {room:,} a "
                "prompt can hold; type your question and press enter."
            )

    def _tokens_of(self, session_id: str, attachment: Attachment) -> int:
        """The tokens `attachment` adds to a message (its text less the template's own)."""
        alone, _ = self.service.message_size(session_id, attachment.block)
        empty, _ = self.service.message_size(session_id, "")
        return alone - empty

    async def changed(self) -> None:
        """The composer's attachments changed: show the chips, count the new ones."""
        attachments = self.composer.attachments
        await self.chips.show(attachments, self._tokens)
        unknown = [a for a in attachments if a.block not in self._tokens]
        current = self.current()
        if unknown and current is not None:
            self.host.run_worker(
                lambda: self._count(current, unknown),
                thread=True,
                exit_on_error=False,
                group="count",
            )

    def _count(self, session_id: str, attachments: list[Attachment]) -> None:
        """Thread worker: token counts for chips loaded with a stored message."""
        with contextlib.suppress(KvchatError):
            counts = {a.block: self._tokens_of(session_id, a) for a in attachments}
            self.host.app.call_from_thread(self._counted, counts)

    async def _counted(self, counts: dict[str, int]) -> None:
        self._tokens.update(counts)
        await self.chips.show(self.composer.attachments, self._tokens)

    def remove(self, index: int) -> None:
        """A chip was clicked: its file is taken off the message."""
        self.composer.detach(index)
        self.composer.focus()
