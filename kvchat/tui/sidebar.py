"""The sidebar: a row per session: title, state, residency bar, context fullness, unread mark.

Why rows are updated in place: sessions change state many times a second while
they stream; rebuilding the list would flicker and lose the scroll position.
Rows are rebuilt only when sessions appear or disappear. Rows are in the order
of the sessions' numbers (`kvchat/chat/session_numbers.py`), which a session keeps
for its life: alt+1..9 keep pointing at the same sessions when others are created,
stream, are archived or deleted (archived ones, when shown, come last, unnumbered).

Why a row compares before it repaints: the app refreshes busy sessions' rows 4
times a second, but what a row shows changes far less often (the context
percentage every few dozen tokens, the state a few times a reply). A row
repaints only when one of its `row_fields` changed, and lays the screen out only
when its height did; UI-thread time is taken from the engine's (one GIL).
"""

from __future__ import annotations

from collections.abc import Sequence

from textual import events
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import Static

from kvchat.chat.session import SessionView, TurnState
from kvchat.engine.api import Residency
from kvchat.tui.repaint import update_static

BAR_WIDTH = 16
# Under the list (the sidebar's border subtitle); the help screen explains it in full.
LEGEND = "█device ▓host ▒disk ░none"  # fits the border of a 32-column sidebar
# with a remote server no residency is known: each row shows the last turn's hit rate
REMOTE_LEGEND = "last hit: the server's cache"
HELP = """Sidebar, one row a session:
  N ● Title     N is the session's number (alt+N shows it; a session keeps it while it
                lives, whatever happens to the others); ● unread reply
  state         idle, queued, prefilling, decoding or preempted (+N: messages waiting)
  ████▓▓▒░ ctx  where the session's history lives in the KV cache, in proportion to
                its tokens: █ on the compute device (instant), ▓ in the host tier
                (copied back, fast), ▒ only on disk (read back), ░ in no tier
                (computed again at the next turn); ctx N% is how full the model's
                context is with this session's history
  last hit N%   with a remote server, which cannot say where a session's history
                is: the share of its last turn's prompt the server had cached"""


def residency_bar(residency: Residency | None, width: int = BAR_WIDTH) -> Content:
    """`width` cells: device (█), host only (▓), disk only (▒), nowhere (░), by tokens."""
    cells = bar_cells(residency, width)
    if cells is None:
        return Content.from_markup("[$text-muted]" + "·" * width)
    device, host, disk, nowhere = cells
    return Content.from_markup(
        f"[$success]{'█' * device}[/][$secondary]{'▓' * host}[/]"
        f"[$primary]{'▒' * disk}[/][$text-muted]{'░' * nowhere}[/]"
    )


def bar_cells(
    residency: Residency | None, width: int = BAR_WIDTH
) -> tuple[int, int, int, int] | None:
    """(device, host, disk, nowhere) cells of the residency bar; None when nothing to show."""
    # the engine may return its own type with these fields (no `total`; a fake may lack disk)
    disk_tokens = 0 if residency is None else getattr(residency, "disk", 0)
    total = (
        0
        if residency is None
        else residency.device + residency.host + disk_tokens + residency.nowhere
    )
    if residency is None or total == 0:
        return None
    device = round(width * residency.device / total)
    host = min(width - device, round(width * residency.host / total))
    disk = min(width - device - host, round(width * disk_tokens / total))
    return device, host, disk, width - device - host - disk


def row_fields(index: int, view: SessionView, residency: Residency | None) -> tuple:
    """Everything a row shows, as plain values: equal fields, equal row (nothing to repaint)."""
    fraction = view.context_fraction
    return (
        f"{index}" if 1 <= index <= 9 and not view.archived else " ",
        view.unread,
        view.title[:40],
        view.state + (f" +{view.queued_says}" if view.queued_says else ""),
        view.state == TurnState.IDLE,
        "ctx —" if fraction is None else f"ctx {fraction:4.0%}",
        bar_cells(residency),
        _last_hit(view),
    )


def _last_hit(view: SessionView) -> str | None:
    """The last turn's hit rate, shown where no residency can be drawn (a remote server
    cannot say where a conversation's prefix lives)."""
    last = view.last_turn
    hit = last.hit_rate if last is not None and last.prompt_tokens else None
    return None if hit is None else f"last hit {hit:.0%}".ljust(BAR_WIDTH)


def row_content(index: int, view: SessionView, residency: Residency | None) -> Content:
    return _content_from_fields(row_fields(index, view, residency), residency)


def _content_from_fields(fields: tuple, residency: Residency | None) -> Content:
    number, unread, title, state, idle, context, cells, last_hit = fields
    unread_mark = "[$accent]●[/] " if unread else ""
    state_style = "$text-muted" if idle else "$warning"
    head = Content.from_markup(f"[$text-muted]{number}[/] {unread_mark}").append(Content(title))
    line2 = Content.from_markup(f"  [{state_style}]$state[/]", state=state)
    bar = residency_bar(residency) if cells is not None or last_hit is None else Content(last_hit)
    line3 = Content.assemble("  ", bar, f" {context}")
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
        self._shown: tuple | None = None  # the row_fields on screen
        self._render_row()

    def set_view(self, view: SessionView, index: int | None = None) -> None:
        self.view = view
        if index is not None:
            self.index = index
        self.set_class(view.unread, "-unread")
        self.set_class(view.state != TurnState.IDLE, "-busy")
        self._render_row()

    def set_residency(self, residency: Residency) -> None:
        if residency != self.residency:
            self.residency = residency
            self._render_row()

    def _render_row(self) -> None:
        fields = row_fields(self.index, self.view, self.residency)
        if fields != self._shown:
            self._shown = fields
            update_static(self, _content_from_fields(fields, self.residency))

    def on_click(self, event: events.Click) -> None:
        self.post_message(self.Selected(self.session_id))


class SessionList(VerticalScroll):
    """The rows by session number (archived ones last); `current` is highlighted."""

    can_focus = False

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Sessions"
        self.border_subtitle = LEGEND
        self.current: str | None = None
        self.order: list[str] = []
        self._rows: dict[str, SessionRow] = {}  # kept, not queried: rows update 4 times a second

    def rows(self) -> dict[str, SessionRow]:
        return dict(self._rows)

    async def set_sessions(self, views: Sequence[SessionView]) -> None:
        """Rebuild when the set of sessions changed; else update the rows in place."""
        ordered = sorted(views, key=lambda v: (v.archived, v.number, v.created, v.id))
        ids = [v.id for v in ordered]
        if ids == self.order:
            for view in ordered:
                self._rows[view.id].set_view(view, view.number)
            return
        old = self._rows
        new_rows = []
        for view in ordered:
            row = SessionRow(view, view.number)
            if view.id in old and old[view.id].residency is not None:
                row.residency = old[view.id].residency
                row.set_view(view, view.number)
            row.set_class(view.id == self.current, "-current")
            new_rows.append(row)
        # order and rows change together, before the awaits: a refresh arriving while these
        # rows mount must find the rows of the order it sees
        self.order = ids
        self._rows = {row.session_id: row for row in new_rows}
        with self.app.batch_update():
            await self.remove_children()
            await self.mount_all(new_rows)

    def update_view(self, view: SessionView) -> None:
        row = self._rows.get(view.id)
        if row is not None:
            row.set_view(view)

    def set_current(self, session_id: str | None) -> None:
        self.current = session_id
        for row in self._rows.values():
            row.set_class(row.session_id == session_id, "-current")
            if row.session_id == session_id:
                self.scroll_to_widget(row, animate=False)
