"""Updating a widget's text without a screen layout when its size stays the same.

Why: `Static.update` asks for a layout by default, and a Textual layout arranges
every widget on the screen and repaints whatever moved: several milliseconds of
Python on the UI thread. The UI thread shares the GIL (and, on small machines,
the cores) with the engine thread, so those milliseconds come straight out of
token generation. While replies stream, the transcript's last paragraph changes
20 times a second and the sidebar rows and meters 4 times a second, yet almost
every change keeps the widget's size (a token rarely wraps a line). Such a
change only needs that one widget repainted; the rare one that changes the size
still gets its layout.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static


def same_content(a: Content | str, b: Content | str) -> bool:
    """Text and styles equal (`Content.__eq__` compares only the text)."""
    if isinstance(a, Content) and isinstance(b, Content):
        return a.plain == b.plain and a.spans == b.spans
    return type(a) is type(b) and a == b


def _content_size(widget: Static) -> tuple[int | None, int]:
    """The content's width (None unless the width is auto) and height, as a layout measures them.

    Measured with the container the widget was last laid out in, so that the value
    before an update and the value after it compare like for like.
    """
    styles = widget.styles
    viewport = widget.app.size
    width = None
    if styles.width is not None and styles.width.is_auto:
        container = widget.container_size - styles.gutter.totals - styles.margin.totals
        width = widget.get_content_width(container, viewport)
    content = widget.content_size
    return width, widget.get_content_height(content, viewport, content.width)


def update_static(widget: Static, content: Content | str) -> None:
    """Show `content` in `widget`; lay the screen out only when the widget's size changes."""
    if not widget.is_mounted or not widget.content_size.width:
        widget.update(content)  # not laid out yet (or not on screen): nothing to compare with
        return
    before = _content_size(widget)  # cached by Textual since the last layout: cheap
    widget.update(content, layout=False)  # drops those caches: the next call measures anew
    if _content_size(widget) != before:
        widget.refresh(layout=True)
