"""`StreamingMarkdown`: Textual's `Markdown` whose last block is updated in place while it grows.

Why: `Markdown.append` (behind `MarkdownStream`) re-parses the last block, builds
new widgets for all of it, and hands them to the mounted block's
`_update_from_block`. Textual then updates a paragraph in place, but with a
layout of the whole screen each time, and replaces a list (every item, bullet
and paragraph in it) or a block quote by removing it and mounting the new one:
tens of widgets built, mounted and styled 20 times a second while a model writes
a list, on the UI thread that shares the GIL with the engine.

Here, when the re-parsed last block keeps its structure (the usual case: a few
words added to its last paragraph), only the paragraphs whose text changed get
new content and no widget is built; a paragraph asks for a layout only when its
height changes (`update_static`). When the structure changed, Textual's append
runs, and a list or quote whose items so far keep their kinds is still patched
(changed paragraphs updated, new items mounted at the end). Anything else (a
paragraph turning into a list, a table…) falls back to Textual's replacement,
so the document shown is always what a fresh parse of the whole text shows.

A new line of text still changes the paragraph's height, which costs a layout
of the whole screen (two, in fact: Textual lays out again when the sizes it set
changed). So the paragraph at the end of a streaming document keeps spare blank
lines below its text (`RESERVE_LINES`): a new line fills a spare one, and only
one line in `RESERVE_LINES` costs layouts. The spare lines are at the end of
the streaming reply, and `end_stream` gives them back when it ends. A paragraph
that starts streaming takes its spare lines before its first layout, in the one
its mount costs anyway, instead of a frame later in a layout of its own (measured:
docs/tui.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from markdown_it import MarkdownIt
from markdown_it.token import Token
from textual.await_complete import AwaitComplete
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Label, Markdown
from textual.widgets._markdown import (  # the block classes are only exported here
    MarkdownBlock,
    MarkdownBlockQuote,
    MarkdownBullet,
    MarkdownBulletList,
    MarkdownFence,
    MarkdownListItem,
    MarkdownOrderedList,
    MarkdownOrderedListItem,
    MarkdownParagraph,
)

from kvchat.tui.repaint import same_content, update_static

# spare lines the live paragraph keeps below its text: a new line of text then fills a
# spare line instead of growing the widget, so only one line in RESERVE_LINES costs a
# screen layout (and Textual's second layout for the sizes that changed)
RESERVE_LINES = 5


class StreamParagraph(MarkdownParagraph):
    """A paragraph that repaints alone when its new text keeps its height.

    While it is the live end of a streamed document (`set_live`) it keeps up to
    `RESERVE_LINES - 1` blank lines below its text, so that most new lines need no layout.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._live = False
        self._reserved = 0  # the min-height held while live (0: none yet)

    def set_content(self, content: Content) -> None:
        if same_content(content, self._content):
            return
        self._content = content
        if not self._live or not self.is_mounted or not self.content_size.width:
            update_static(self, content)
            return
        self.update(content, layout=False)
        self._grow_reserve()

    def set_live(self, live: bool) -> None:
        """Start keeping spare lines below the text, or stop and give them back."""
        self._live = live
        if live:
            if self.is_mounted and self.content_size.width:
                self._grow_reserve()
            else:  # just mounted: reserve now, in the layout its mount costs anyway
                self._reserved = RESERVE_LINES
                self.styles.min_height = RESERVE_LINES
        elif self._reserved:
            self._reserved = 0
            self.styles.min_height = None

    def _grow_reserve(self) -> None:
        """When the text outgrew the spare lines, take `RESERVE_LINES - 1` more (one layout)."""
        size = self.content_size
        height = self.get_content_height(size, self.app.size, size.width)
        if height > self._reserved:
            self._reserved = height + RESERVE_LINES - 1
            self.styles.min_height = self._reserved


class StreamFence(MarkdownFence):
    """A code block whose growing code repaints alone when its size holds.

    Long lines wrap at the block's width: Textual's fence scrolls sideways with its
    scrollbar hidden, so the end of a long line was simply not there to read (and no
    key reaches it from the composer)."""

    DEFAULT_CSS = """
    StreamFence {
        overflow: hidden hidden;
        & > Label { width: 1fr; text-wrap: wrap; }
    }
    """

    def set_content(self, content: Content) -> None:
        self._content = content
        with contextlib.suppress(NoMatches):
            update_static(self.query_one("#code-content", Label), content)


class StreamBlockQuote(MarkdownBlockQuote):
    async def _update_from_block(self, block: MarkdownBlock) -> None:
        if not await patch_block(self, block):
            await super()._update_from_block(block)


class StreamBulletList(MarkdownBulletList):
    async def _update_from_block(self, block: MarkdownBlock) -> None:
        if not await patch_block(self, block):
            await super()._update_from_block(block)


class StreamOrderedList(MarkdownOrderedList):
    async def _update_from_block(self, block: MarkdownBlock) -> None:
        if not await patch_block(self, block):
            await super()._update_from_block(block)


def _parser() -> MarkdownIt:
    """The in-place path's parser, one per thread (its linkify keeps state between calls).

    Building a "gfm-like" parser costs about as much as parsing a streamed paragraph,
    which `Markdown.append` does on every call. Textual's own `update` and `append`
    keep building theirs: `update` parses in an executor thread.
    """
    parser = getattr(_parsers, "parser", None)
    if parser is None:
        parser = _parsers.parser = MarkdownIt("gfm-like")
    return parser


_parsers = threading.local()


# block tokens the in-place path understands: their inline text maps one to one onto
# paragraphs (headings get an id from their text, tables and fences build other widgets)
_PATCHABLE = frozenset(
    {
        "paragraph_open",
        "paragraph_close",
        "inline",
        "bullet_list_open",
        "bullet_list_close",
        "ordered_list_open",
        "ordered_list_close",
        "list_item_open",
        "list_item_close",
        "blockquote_open",
        "blockquote_close",
    }
)


def _skeleton(tokens: Sequence[Token]) -> tuple | None:
    """The block structure of a parse, without the text; None when it is not patchable."""
    if any(t.type not in _PATCHABLE for t in tokens):
        return None
    if sum(1 for t in tokens if t.level == 0 and t.nesting == 1) != 1:
        return None  # one top-level block: the one the next append re-parses
    return tuple((t.type, t.tag, t.level, t.info, t.markup, t.hidden) for t in tokens)


def _paragraphs(block: Widget) -> list[MarkdownParagraph]:
    """The paragraphs under `block` in document order (the order of their inline tokens)."""
    out: list[MarkdownParagraph] = []
    stack = [block]
    while stack:
        widget = stack.pop()
        if isinstance(widget, MarkdownParagraph):
            out.append(widget)
        else:
            stack.extend(reversed(widget.children))
    return out


@dataclass
class _LastBlock:
    """The last top-level block as parsed and mounted, for the next append to patch."""

    start: int  # its first line (Markdown._last_parsed_line)
    skeleton: tuple
    block: MarkdownBlock
    paragraphs: list[MarkdownParagraph]
    texts: list[str]  # each paragraph's inline source


class StreamingMarkdown(Markdown):
    """`Markdown` that updates its growing last block in place (see the module docstring).

    `write` (or `append`) first tries the fast path: when the re-parsed last block has
    the same structure as the mounted one (the usual case: text added to its last
    paragraph), only the paragraphs whose text changed get new content, and no widget
    is built. Otherwise Textual's own `append` runs, with the block classes above
    patching what they can. Call `end_stream` when the streamed text is complete.
    """

    BLOCKS: ClassVar[dict[str, type[MarkdownBlock]]] = {
        **Markdown.BLOCKS,
        "paragraph_open": StreamParagraph,
        "blockquote_open": StreamBlockQuote,
        "bullet_list_open": StreamBulletList,
        "ordered_list_open": StreamOrderedList,
        "fence": StreamFence,
        "code_block": StreamFence,
    }

    def __init__(self, markdown: str | None = None, *, classes: str | None = None) -> None:
        super().__init__(markdown, classes=classes)
        self._last: _LastBlock | None = None
        self._live: StreamParagraph | None = None  # the paragraph text is streaming into

    def update(self, markdown: str) -> AwaitComplete:
        self._last = None
        self._set_live(None)
        return super().update(markdown)

    def end_stream(self) -> None:
        """The stream ended: the live paragraph gives back its spare lines."""
        self._set_live(None)

    def _set_live(self, paragraph: StreamParagraph | None) -> None:
        if self._live is not None and self._live is not paragraph:
            self._live.set_live(False)
        self._live = paragraph
        if paragraph is not None:
            paragraph.set_live(True)

    def append(self, markdown: str) -> AwaitComplete:
        return AwaitComplete(self.write(markdown))

    async def write(self, markdown: str) -> None:
        """`append`, as a plain coroutine: no task per call (the transcript calls it per tick)."""
        if not markdown or await self._append_in_place(markdown):
            return
        self._last = None
        await super().append(markdown)
        self._last = self._remember_last()
        self._set_live(self._last_leaf())

    def _last_leaf(self) -> StreamParagraph | None:
        """The paragraph at the very end of the document, if the document ends in one."""
        widget: Widget = self
        while widget.children:
            widget = widget.children[-1]
        return widget if isinstance(widget, StreamParagraph) else None

    async def _append_in_place(self, markdown: str) -> bool:
        last = self._last
        if last is None or last.start != self._last_parsed_line or not last.block.is_attached:
            return False
        source = self.source + markdown
        async with self.lock:
            tokens = _parser().parse("".join(source.splitlines(keepends=True)[last.start :]))
            if _skeleton(tokens) != last.skeleton:
                return False
            self._markdown = source
            inlines = [t for t in tokens if t.type == "inline"]
            for i, (paragraph, token) in enumerate(zip(last.paragraphs, inlines, strict=True)):
                if token.content != last.texts[i]:
                    last.texts[i] = token.content
                    paragraph._inline_token = token
                    paragraph.set_content(paragraph._token_to_content(token))
            if tokens[0].map is not None:
                first, end = tokens[0].map
                last.block.source_range = (last.start + first, last.start + end)
        return True

    def _remember_last(self) -> _LastBlock | None:
        """After Textual's append: what the fast path needs, when the last block allows it."""
        blocks = [child for child in self.children if isinstance(child, MarkdownBlock)]
        if not blocks:
            return None
        start = self._last_parsed_line
        tokens = _parser().parse("".join(self.source.splitlines(keepends=True)[start:]))
        skeleton = _skeleton(tokens)
        if skeleton is None:
            return None
        paragraphs = _paragraphs(blocks[-1])
        texts = [t.content for t in tokens if t.type == "inline"]
        if len(paragraphs) != len(texts):
            return None  # not what a fresh parse mounts (yet): stay on Textual's path
        return _LastBlock(start, skeleton, blocks[-1], paragraphs, texts)


def _list_symbols(block: MarkdownBlock, items: Sequence[MarkdownBlock]) -> list[str]:
    """The bullets the list's own `compose` would give these items."""
    bullets = [item.bullet for item in items if isinstance(item, MarkdownListItem)]
    if not isinstance(block, MarkdownOrderedList):
        return bullets
    start = 1
    if items and isinstance(items[0], MarkdownOrderedListItem):
        with contextlib.suppress(ValueError):
            start = int(items[0].bullet)
    numbers = [f"{n}. " for n in range(start, start + len(items))]
    size = max((len(n) for n in numbers), default=0)
    return [n.rjust(size + 1) for n in numbers]


def _list_rows(block: Widget) -> list[tuple[MarkdownBullet, Vertical]] | None:
    """A mounted list's (bullet, item body) pairs, as its compose made them."""
    rows = []
    for row in block.children:
        parts = list(row.children)
        if not isinstance(row, Horizontal) or len(parts) != 2:
            return None
        bullet, body = parts
        if not isinstance(bullet, MarkdownBullet) or not isinstance(body, Vertical):
            return None
        rows.append((bullet, body))
    return rows


def _fits(old: Widget, new: MarkdownBlock) -> bool:
    """Can the mounted `old` be patched into the freshly parsed (unmounted) `new`?

    `new`'s children are still in `_blocks` (what its compose would yield). Nothing is
    changed here, so a False leaves `old` intact for Textual's replacement.
    """
    if type(old) is not type(new):
        return False
    if isinstance(old, MarkdownParagraph | MarkdownFence):
        return True
    if isinstance(old, MarkdownBulletList | MarkdownOrderedList):
        rows = _list_rows(old)
        items = new._blocks
        return (
            rows is not None
            and len(items) >= len(rows)
            and all(isinstance(item, MarkdownListItem) for item in items)
            and all(
                _children_fit(body, item._blocks)
                for (_, body), item in zip(rows, items, strict=False)
            )
        )
    if isinstance(old, MarkdownBlockQuote):
        return _children_fit(old, new._blocks)
    return False


def _children_fit(container: Widget, blocks: Sequence[MarkdownBlock]) -> bool:
    children = list(container.children)
    return len(blocks) >= len(children) and all(
        _fits(child, block) for child, block in zip(children, blocks, strict=False)
    )


async def patch_block(old: MarkdownBlock, new: MarkdownBlock) -> bool:
    """Make the mounted `old` show the freshly parsed `new` in place; False: replace it instead."""
    if not _fits(old, new):
        return False
    await _apply(old, new)
    return True


async def _apply(old: Widget, new: MarkdownBlock) -> None:
    """`_fits(old, new)` holds: update what changed, mount what is new."""
    if isinstance(old, MarkdownParagraph):
        old._copy_context(new)
        old.set_content(new._content)
        return
    if isinstance(old, MarkdownFence):
        await old._update_from_block(new)  # Textual's own in-place fence update
        return
    assert isinstance(old, MarkdownBlock)
    old._copy_context(new)
    if isinstance(old, MarkdownBlockQuote):
        await _apply_children(old, new._blocks)
        return
    rows = _list_rows(old) or []
    items = new._blocks
    symbols = _list_symbols(new, items)
    for (bullet, body), item, symbol in zip(rows, items, symbols, strict=False):
        await _apply_children(body, item._blocks)
        if bullet.symbol != symbol:
            bullet.symbol = symbol
            bullet.refresh(layout=True)  # its width follows the symbol's
    new_rows = []
    for item, symbol in zip(items[len(rows) :], symbols[len(rows) :], strict=True):
        bullet = MarkdownBullet()
        bullet.symbol = symbol
        new_rows.append(Horizontal(bullet, Vertical(*item._blocks)))
    if new_rows:
        await old.mount_all(new_rows)


async def _apply_children(container: Widget, blocks: Sequence[MarkdownBlock]) -> None:
    children = list(container.children)
    for child, block in zip(children, blocks, strict=False):
        await _apply(child, block)
    if len(blocks) > len(children):
        await container.mount_all(blocks[len(children) :])
