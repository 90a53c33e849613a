"""The TUI's cheap repaints: streamed Markdown equals a fresh parse, unchanged widgets stay put.

Why these matter: the UI thread shares the GIL with the engine, so the transcript
and sidebar must not lay the screen out (or rebuild widgets) when what they show
has not changed; and the in-place Markdown updates must still show exactly what
Textual's own parse of the whole text shows.
"""

from __future__ import annotations

import random

import pytest
from textual.app import App, ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Markdown, Static

from kvchat.chat.engine_port import Residency
from kvchat.chat.session import MessageState, MessageView
from kvchat.tui.app import KvchatApp
from kvchat.tui.markdown import RESERVE_LINES, StreamingMarkdown, StreamParagraph
from kvchat.tui.repaint import update_static
from kvchat.tui.sidebar import SessionRow
from kvchat.tui.themes import PanelBorderVariable
from kvchat.tui.transcript import MessageBlock
from tests.tui_helpers import session_view

DOCUMENTS = [
    "Hello **world** and *more* text with `code`.\n\nSecond paragraph, a [link](http://x.y).",
    "1. 1984: The 1984 World Series was a major event. The game was played.\n"
    "2. Second item *emph*\n3. Third\n\nAfter the list.",
    "- a\n- b\n  - nested one\n  - nested two\n- c with **bold**\n\n"
    "> quote line one\n> quote line two\n\nend",
    "# Title\n\nSome text\n\n```python\ndef f(x):\n    return x\n```\n\nfin",
    "1.1.1.1.1.1.1.1.1.1.1.1.1.1.",
    "8. eight\n9. nine\n10. ten\n11. eleven\n",
    "Text\nmore text\n---\nafter *open emphasis never closed",
]


def _shape(widget: Widget, depth: int = 0) -> list[tuple]:
    """What a Markdown document shows: block kinds (Textual's classes), texts, styles, bullets."""
    out: list[tuple] = []
    for child in widget.children:
        kind = next(c.__name__ for c in type(child).__mro__ if c.__module__.startswith("textual"))
        content = getattr(child, "_content", None)
        spans = [(s.start, s.end, str(s.style)) for s in content.spans] if content else None
        text = content.plain if content else None
        out.append((depth, kind, text, spans, getattr(child, "symbol", None)))
        out += _shape(child, depth + 1)
    return out


class _Host(App[None]):
    def compose(self) -> ComposeResult:
        yield Static("host")


def spy_on_refresh(widget) -> list[bool]:
    """Record, per `widget.refresh` call, whether it asked for a layout (and still refresh)."""
    layouts: list[bool] = []
    refresh = widget.refresh

    def spy(*regions, **kwargs):
        layouts.append(bool(kwargs.get("layout")))
        return refresh(*regions, **kwargs)

    widget.refresh = spy
    return layouts


@pytest.mark.parametrize("document", DOCUMENTS)
async def test_streamed_markdown_shows_what_a_fresh_parse_shows(document):
    rng = random.Random(document)
    app = _Host()
    async with app.run_test() as pilot:
        streamed = StreamingMarkdown("")
        await app.mount(streamed)
        await pilot.pause()
        i = 0
        while i < len(document):
            n = rng.randint(1, 7)
            await streamed.write(document[i : i + n])
            i += n
            if rng.random() < 0.3:
                await pilot.pause()  # a screen update now and then, as the app's timer gives
        streamed.end_stream()
        fresh = Markdown(document)
        await app.mount(fresh)
        await pilot.pause()
        assert streamed.source == document
        assert _shape(streamed) == _shape(fresh)
        assert streamed.size == fresh.size  # no spare lines left behind


async def _write(streamed: StreamingMarkdown, pilot, *pieces: str) -> None:
    """Stream `pieces` one by one, with a screen update after each (as the app's timer does)."""
    for piece in pieces:
        await streamed.write(piece)
        await pilot.pause()


async def _stream(app: App, pilot, *pieces: str) -> StreamingMarkdown:
    streamed = StreamingMarkdown("")
    await app.mount(streamed)
    await _write(streamed, pilot, *pieces)
    return streamed


async def test_the_live_paragraph_grows_in_place_into_spare_lines_given_back_at_the_end():
    app = _Host()
    async with app.run_test(size=(40, 20)) as pilot:
        streamed = await _stream(app, pilot, "1. start", " of")
        [paragraph] = streamed.query(StreamParagraph)
        assert paragraph.size.height == RESERVE_LINES  # one line of text, spare lines below
        layouts = spy_on_refresh(paragraph)
        await _write(streamed, pilot, " a", " line", " that wraps onto the next line")
        assert list(streamed.query(StreamParagraph)) == [paragraph]  # the same widget
        assert layouts and not any(layouts)  # the second line filled a spare one: repaints only
        streamed.end_stream()
        await pilot.pause()
        assert paragraph.size.height == 2  # the text's own height again


async def test_a_new_live_paragraph_has_its_spare_lines_from_its_first_layout():
    """The layout that mounts a paragraph also gives it its spare lines: no second one later."""
    app = _Host()
    async with app.run_test(size=(40, 20)) as pilot:
        streamed = await _stream(app, pilot, "The first paragraph.", "\n\nThe second")
        first, second = streamed.query(StreamParagraph)
        assert second.size.height == RESERVE_LINES  # reserved in the layout of its mount
        assert first.size.height == 1  # the earlier paragraph gave its spare lines back
        layouts = spy_on_refresh(second)
        await _write(streamed, pilot, " one")
        assert layouts and not any(layouts)


class _StyledHost(PanelBorderVariable, App[None]):
    """The app's own stylesheet around one message body, as the transcript nests it."""

    CSS_PATH = KvchatApp.CSS_PATH

    def compose(self) -> ComposeResult:
        with Vertical(classes="message -assistant"):
            yield StreamingMarkdown("", classes="message-body")


async def test_a_new_paragraph_restyles_no_earlier_block_of_a_long_reply(monkeypatch):
    """A rule with :last-child (or another order pseudo-class) on the blocks makes Textual
    restyle every earlier block of the reply at each mount: a long reply's frames then grow
    with its length (a 2,048-token reply's flushes went from 1.4 to 4.1 ms)."""
    app = _StyledHost()
    async with app.run_test(size=(60, 40)) as pilot:
        streamed = app.query_one(StreamingMarkdown)
        await _write(streamed, pilot, *(f"Paragraph number {i}.\n\n" for i in range(20)))
        restyled: list[Widget] = []
        update = Widget.update_node_styles

        def spy(self, *args, **kwargs):
            restyled.append(self)
            return update(self, *args, **kwargs)

        monkeypatch.setattr(Widget, "update_node_styles", spy)
        await _write(streamed, pilot, "One more", " paragraph.\n\n", "And another")
        assert len(streamed.query(StreamParagraph)) == 22
        assert len(restyled) <= 2, [type(w).__name__ for w in restyled]


def _message(content: str, state: MessageState, index: int) -> MessageView:
    return MessageView(f"m{index}", index, "assistant", content, state, True, None)


class _Messages(PanelBorderVariable, App[None]):
    CSS_PATH = KvchatApp.CSS_PATH

    def __init__(self, first: MessageView) -> None:
        super().__init__()
        self.first = first

    def compose(self) -> ComposeResult:
        yield MessageBlock(self.first)
        yield MessageBlock(_message("Next.", MessageState.COMPLETE, 1))


@pytest.mark.parametrize(
    ("first", "lines"),
    [
        (_message("One line of text.", MessageState.COMPLETE, 0), 3),  # header, text, gap
        (_message("", MessageState.CANCELLED, 0), 2),  # header, gap: no block gives it
    ],
)
async def test_one_blank_line_follows_every_message(first, lines):
    app = _Messages(first)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        a, b = app.query(MessageBlock)
        assert b.region.y - a.region.y == lines


async def test_update_static_repaints_without_layout_when_the_height_holds():
    app = _Host()
    async with app.run_test(size=(30, 10)) as pilot:
        widget = app.query_one(Static)
        await pilot.pause()
        calls = spy_on_refresh(widget)
        update_static(widget, "same height")
        assert calls == [False]
        update_static(widget, "line one\nline two")
        assert calls[-1] is True
        await pilot.pause()
        assert widget.size.height == 2


async def test_sidebar_row_repaints_only_when_what_it_shows_changes():
    class RowApp(App[None]):
        def compose(self) -> ComposeResult:
            yield SessionRow(session_view(), 1)

    app = RowApp()
    async with app.run_test(size=(40, 10)) as pilot:
        row = app.query_one(SessionRow)
        await pilot.pause()
        updates: list[object] = []
        update = row.update

        def spy(content="", **kwargs):
            updates.append(content)
            return update(content, **kwargs)

        row.update = spy  # type: ignore[method-assign]
        row.set_view(session_view(context_tokens=101))  # ctx 2% either way
        row.set_residency(Residency(100, 0, nowhere=1))
        row.set_residency(Residency(101, 0, nowhere=1))  # the same bar cells
        assert len(updates) == 1  # the residency bar appeared; nothing else showed a change
        row.set_view(session_view(state="idle"))
        assert len(updates) == 2


async def test_a_long_code_line_wraps_so_all_of_it_is_on_screen():
    from kvchat.tui.markdown import StreamFence

    line = "x = compute(" + ", ".join(f"argument_{i}" for i in range(20)) + ")  # END"
    app = _Host()
    async with app.run_test(size=(80, 30)) as pilot:
        streamed = await _stream(app, pilot, "Here:\n\n```python\n", line + "\n", "```\n")
        streamed.end_stream()
        await pilot.pause()
        (fence,) = streamed.query(StreamFence)
        assert fence.max_scroll_x == 0  # nothing beyond the right edge
        code = fence.query_one("#code-content")
        text = "\n".join(strip.text for strip in code.render_lines(code.region))
        assert "# END" in text and text.count("\n") >= 1  # wrapped onto more lines
        assert code.region.right <= fence.region.right
