"""The sidebar: a row per session: title, state, residency bar, context fullness, unread mark.

Why rows are updated in place: sessions change state many times a second while
they stream; rebuilding the list would flicker and lose the scroll position.
Rows are rebuilt only when sessions appear or disappear. The order is by
creation (newest first) so that alt+1..9 keep pointing at the same sessions
while they stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import Static

from kvchat.chat.engine_port import Residency
from kvchat.chat.session import SessionView

BAR_WIDTH = 16


def residency_bar(residency: Residency | None, width: int = BAR_WIDTH) -> Content:
    """`width` cells: device (█), host only (▓), nowhere (░), proportional to tokens."""
    # the engine may return its own type with these three fields (no `total`)
    total = 0 if residency is None else residency.device + residency.host + residency.nowhere
    if residency is None or total == 0:
        return Content.from_markup("[$text-muted]" + "·" * width)
    device = round(width * residency.device / total)
    host = min(width - device, round(width * residency.host / total))
    nowhere = width - device - host
    return Content.from_markup(
        f"[$success]{'█' * device}[/][$secondary]{'▓' * host}[/][$text-muted]{'░' * nowhere}[/]"
    )


def row_content(index: int, view: SessionView, residency: Residency | None) -> Content:
    number = f"{index}" if index <= 9 else " "
    unread = "[$accent]●[/] " if view.unread else ""
    state = view.state + (f" +{view.queued_says}" if view.queued_says else "")
    state_style = "$text-muted" if view.state == "idle" else "$warning"
    fraction = view.context_fraction
    context = "ctx —" if fraction is None else f"ctx {fraction:4.0%}"
    title = Content(view.title[:40])
    head = Content.from_markup(f"[$text-muted]{number}[/] {unread}").append(title)
    line2 = Content.from_markup(f"  [{state_style}]$state[/]", state=state)
    line3 = Content.assemble("  ", residency_bar(residency), f" {context}")
    return Content("\n").join([head, line2, line3])


class SessionRow(Static):
    """One session; click to switch."""

    class Selected(Message):
        def __init__(self, session_id: str) -> None:
            super().__init__()
            self.session_id = session_id

    def __init__(self, view: SessionView, index: int) -> None:
        super().__init__(id=f"session-{view.id}", classes="session-row")
        self.session_id = view.id
        self.view = view
        self.index = index
        self.residency: Residency | None = None
        self._render_row()

    def set_view(self, view: SessionView, index: int | None = None) -> None:
        self.view = view
        if index is not None:
            self.index = index
        self.set_class(view.unread, "-unread")
        self.set_class(view.state != "idle", "-busy")
        self._render_row()

    def set_residency(self, residency: Residency) -> None:
        if residency != self.residency:
            self.residency = residency
            self._render_row()

    def _render_row(self) -> None:
        self.update(row_content(self.index, self.view, self.residency))

    def on_click(self, event: events.Click) -> None:
        self.post_message(self.Selected(self.session_id))


class SessionList(VerticalScroll):
    """The rows, newest first; `current` is highlighted."""

    can_focus = False

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Sessions"
        self.current: str | None = None
        self.order: list[str] = []

    def rows(self) -> dict[str, SessionRow]:
        return {row.session_id: row for row in self.query(SessionRow)}

    async def set_sessions(self, views: Sequence[SessionView]) -> None:
        """Rebuild when the set of sessions changed; else update the rows in place."""
        ordered = sorted(views, key=lambda v: v.created, reverse=True)
        ids = [v.id for v in ordered]
        if ids == self.order:
            rows = self.rows()
            for i, view in enumerate(ordered, 1):
                rows[view.id].set_view(view, i)
            return
        old = self.rows()
        self.order = ids
        with self.app.batch_update():
            await self.remove_children()
            new_rows = []
            for i, view in enumerate(ordered, 1):
                row = SessionRow(view, i)
                if view.id in old and old[view.id].residency is not None:
                    row.residency = old[view.id].residency
                    row.set_view(view, i)
                row.set_class(view.id == self.current, "-current")
                new_rows.append(row)
            await self.mount_all(new_rows)

    def update_view(self, view: SessionView) -> None:
        row = self.rows().get(view.id)
        if row is not None:
            row.set_view(view)

    def set_current(self, session_id: str | None) -> None:
        self.current = session_id
        for row in self.query(SessionRow):
            row.set_class(row.session_id == session_id, "-current")
            if row.session_id == session_id:
                self.scroll_to_widget(row, animate=False)
