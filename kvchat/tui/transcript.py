"""The transcript of the current session: one Markdown block per message, the live reply streamed.

Why only the visible session is rendered: hidden sessions keep generating, but
their text never reaches a widget (toolong's rule: the visible thing gets the
frames). A switch renders the chosen session from the service's snapshot, and
only its last `MAX_RENDERED` messages, so a switch costs the same however long
the conversation is. The live reply is appended to a `StreamingMarkdown` once
per UI tick (the app's timer already gathers the tick's tokens into one piece),
which re-parses only the last block and updates it in place, repainting the
one paragraph that grew: the UI thread shares the GIL with the engine, so every
millisecond spent here per tick is one the engine does not get.

Why the end is kept in view after every layout rather than by one scroll when
text is added: the height of what was just mounted is known only after the
screen's next layout. A render scrolled before it (a restarted app showed a long
session's top), and Textual runs a deferred scroll without a layout while another
widget holds a batched update (a reply's Markdown does, to mount its paragraphs),
so the scroll for a message sent could land on the old end; a transcript that
then followed only when exactly at its end never moved again, and the message and
its stored reply stayed below the view. So while it follows the end (`following`:
after a render, a message sent, or the user scrolling to the bottom; not after
the user scrolled up), each change of its content height or of its own size
scrolls it to the new end once that layout has set the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label

from kvchat.chat.session import MessageState, MessageView
from kvchat.tui.markdown import StreamingMarkdown
from kvchat.tui.stream_buffer import Chunk

MAX_RENDERED = 40

_ROLE_TITLES = {"system": "System", "user": "You", "assistant": "Assistant"}
_STATE_NOTES = {
    MessageState.STREAMING: "writing…",
    MessageState.INTERRUPTED: "interrupted (kvchat stopped while it was written)",
    MessageState.CANCELLED: "stopped",
    MessageState.ERROR: "error",
}
_RETRIABLE = frozenset({MessageState.ERROR, MessageState.INTERRUPTED})


def header_text(message: MessageView, retry: str | None = None) -> str:
    """The role and state line; `retry` (the regenerate key) is named under a failed last
    reply: the error says what to change, the key is how to try again after."""
    title = _ROLE_TITLES.get(message.role, message.role.title())
    note = _STATE_NOTES.get(message.state)
    if message.state == MessageState.ERROR and message.stats and message.stats.error:
        note = f"error: {message.stats.error}"
    elif message.state == MessageState.INTERRUPTED and message.stats and message.stats.error:
        note = f"interrupted: {message.stats.error}"  # a server's stream broke mid-reply
    if not message.in_context:
        note = (note + ", " if note else "") + "no longer in the model's context"
    if retry and message.role == "assistant" and message.state in _RETRIABLE:
        note = f"{note} ({retry} tries again)"
    return f"{title} · {note}" if note else title


class MessageBlock(Vertical):
    """One message: a header line (role and state) and its Markdown body."""

    def __init__(self, message: MessageView) -> None:
        super().__init__(classes=f"message -{message.role} -{message.state}")
        self.set_class(not message.content, "-empty")  # no block to give the gap below it
        self.message = message
        self.message_id = message.id
        self.shown = len(message.content)  # characters of the reply rendered so far
        self.retry: str | None = None  # the key named under it while it is the last reply
        self.header = Label(header_text(message), classes="message-header")
        self.body = StreamingMarkdown(message.content, classes="message-body")

    def compose(self):
        yield self.header
        yield self.body

    @property
    def streaming(self) -> bool:
        return self.message.state == MessageState.STREAMING

    async def append(self, chunk: Chunk) -> bool:
        """Add the part of `chunk` not shown yet; False when text before it is missing."""
        if chunk.start > self.shown:
            return False
        piece = chunk.text[self.shown - chunk.start :]
        if piece:
            # awaited here rather than through a MarkdownStream task: the caller runs once
            # per tick with the tick's text, and a tick that overruns delays the next one
            await self.body.write(piece)
            self.shown += len(piece)
            self.remove_class("-empty")  # a no-op (no restyle) once it is gone
        return True

    async def finish(self, message: MessageView) -> None:
        """The reply ended: show the final text (stop strings trimmed)."""
        self.body.end_stream()
        if message.content != self.body.source:
            await self.body.update(message.content)
        self.shown = len(message.content)
        self.set_class(not message.content, "-empty")
        self.set_state(message)

    def set_state(self, message: MessageView) -> None:
        self.remove_class(f"-{self.message.state}")
        self.message = message
        self.add_class(f"-{message.state}")
        self.header.update(header_text(message, self.retry))

    def set_retry(self, retry: str | None) -> None:
        if retry != self.retry:
            self.retry = retry
            self.header.update(header_text(self.message, retry))


class Transcript(VerticalScroll):
    """The current session's messages; `show` renders a session, `append` streams into it.

    While `following`, the last line stays in view as the content grows (see the
    module docstring).
    """

    def __init__(self, *, retry_key: str = "ctrl+r", id: str | None = None) -> None:
        super().__init__(id=id)
        self.retry_key = retry_key  # named under a failed last reply
        self.session_id: str | None = None
        self.following = True  # keep the end in view; False once the user scrolls up
        self._end_due = False  # a scroll to the end is queued

    def blocks(self) -> list[MessageBlock]:
        return [child for child in self.children if isinstance(child, MessageBlock)]

    def block(self, message_id: str) -> MessageBlock | None:
        # newest first, over the children only: the streaming reply is nearly always the last,
        # and a query would walk every Markdown block of every message each tick
        for block in reversed(self.children):
            if isinstance(block, MessageBlock) and block.message_id == message_id:
                return block
        return None

    def show_message(self, message_id: str) -> bool:
        """Scroll `message_id` to the top of the view and stop following the end; False
        when it is not rendered (older than the last `MAX_RENDERED`)."""
        block = self.block(message_id)
        if block is None:
            return False
        self.following = False
        self.call_after_refresh(self.scroll_to_widget, block, animate=False, top=True)
        return True

    # ------------------------------------------------------------ following the end

    def follow_end(self) -> None:
        """Show the end now and keep it in view as the content grows (until the user scrolls
        up); the layout of what was just mounted moves it again when it comes."""
        self.following = True
        self.scroll_end(animate=False, immediate=True)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # every scroll, the user's or ours, says whether the view is at the end now; a layout
        # that grows the content moves no scroll, so it leaves `following` as it was
        self.following = round(new_value) >= self.max_scroll_y

    def watch_virtual_size(self) -> None:
        self._keep_end_later()  # the content's height changed (a layout just measured it)

    def on_resize(self) -> None:
        self._keep_end_later()  # the view's height changed (the composer grew, the terminal)

    def _keep_end_later(self) -> None:
        # once this layout has set every size (it is running now): max_scroll_y is then right
        if self.following and not self._end_due:
            self._end_due = True
            self.call_later(self._keep_end)

    def _keep_end(self) -> None:
        self._end_due = False
        if self.following and self.scroll_offset.y != self.max_scroll_y:
            self.scroll_end(animate=False, immediate=True)

    # ---------------------------------------------------------------- rendering

    async def show(self, session_id: str | None, messages: Sequence[MessageView]) -> None:
        self.session_id = session_id
        hidden = max(0, len(messages) - MAX_RENDERED)
        widgets: list = []
        if hidden:
            widgets.append(
                Label(
                    f"{hidden} earlier messages (export the session to read them all)",
                    classes="earlier",
                )
            )
        widgets += [MessageBlock(m) for m in messages[hidden:]]
        if session_id is None:
            widgets.append(
                Label(
                    "No session yet: type a message below to start one (or press ctrl+n).",
                    classes="empty",
                )
            )
        elif not messages:
            widgets.append(Label("Type a message below and press enter.", classes="empty"))
        self._name_retry([w for w in widgets if isinstance(w, MessageBlock)])
        with self.app.batch_update():
            await self.remove_children()
            await self.mount_all(widgets)
        self.follow_end()

    async def sync(self, session_id: str | None, messages: Sequence[MessageView]) -> None:
        """Bring the rendered session up to `messages`: new blocks mounted, ended replies
        finished; a full render when earlier messages changed (regenerate, edit)."""
        blocks = self.blocks()
        if session_id != self.session_id or not blocks:
            await self.show(session_id, messages)
            return
        ids = [m.id for m in messages]
        try:
            start = ids.index(blocks[0].message_id)
        except ValueError:
            await self.show(session_id, messages)
            return
        if ids[start : start + len(blocks)] != [b.message_id for b in blocks]:
            await self.show(session_id, messages)
            return
        for block, message in zip(blocks, messages[start:], strict=False):
            if block.message.state != message.state or (
                not block.streaming and block.message.content != message.content
            ):
                if message.state == MessageState.STREAMING:
                    block.set_state(message)
                else:
                    await block.finish(message)
        new = messages[start + len(blocks) :]
        if new:
            await self.mount_all([MessageBlock(m) for m in new])
            if any(m.role == "user" for m in new):
                self.follow_end()  # a message sent: show it and its reply, wherever the view was
        self._name_retry()

    def _name_retry(self, blocks: list[MessageBlock] | None = None) -> None:
        """The retry key under the last message only: regenerate replaces the last reply."""
        blocks = self.blocks() if blocks is None else blocks
        for block in blocks:
            block.set_retry(self.retry_key if block is blocks[-1] else None)

    async def append(self, chunk: Chunk) -> bool:
        """Stream `chunk` into its message; False when the message or earlier text is missing.

        The view follows the growing reply by itself while `following`."""
        block = self.block(chunk.message_id)
        if block is None:
            return False
        return await block.append(chunk)
