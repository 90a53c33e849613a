"""The chat screen's frame pump: the text at `FLUSH_HZ`, the meters at `METERS_HZ`.

One timer drives it: each tick repaints the rows whose sessions changed, the
residency bars computed meanwhile, the meters when their turn came, and the
visible session's buffered text, so that all of it shares one screen update (each
update costs the UI thread a millisecond or more whatever it repaints). Residency
is read in a thread worker: it waits on the engine's lock, the UI never does.
Hidden sessions' text is dropped from the buffer: a switch renders from the
service's snapshot anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from textual.timer import Timer
from textual.widget import Widget

from kvchat.chat.service import SessionService
from kvchat.chat.session import SessionView, TurnState
from kvchat.engine.api import Residency
from kvchat.errors import KvchatError
from kvchat.tui.backend import TuiBackend
from kvchat.tui.messages import ResidencyReady
from kvchat.tui.meters import Meters
from kvchat.tui.session_switcher import SessionSwitcher
from kvchat.tui.sidebar import LEGEND, REMOTE_LEGEND, SessionList
from kvchat.tui.stream_buffer import StreamBuffer
from kvchat.tui.transcript import Transcript
from kvchat.tui.type_ahead_sender import TypeAheadSender

FLUSH_HZ = 20
METERS_HZ = 4
RESIDENCY_ALL_EVERY_S = 5.0
NOTE_EVERY_S = 2.0  # the cache note (model, cache sizes, attention) is re-read this often


class FramePump:
    """The tick, the meters and residency of the chat screen (see the module docstring)."""

    def __init__(
        self,
        service: SessionService,
        *,
        buffer: StreamBuffer,
        sessions: SessionSwitcher,
        type_ahead: TypeAheadSender,
        sidebar: SessionList,
        transcript: Transcript,
        meters: Meters,
        transcript_lock: asyncio.Lock,
        backend: Callable[[], TuiBackend],
        host: Widget,
    ) -> None:
        self.service = service
        self.buffer = buffer
        self.sessions = sessions
        self.type_ahead = type_ahead
        self.sidebar = sidebar
        self.transcript = transcript
        self.meters = meters
        self.transcript_lock = transcript_lock  # a switch renders under it too
        self.backend = backend  # the one serving now (a model switch replaces it)
        self.host = host  # owns the timer and the thread workers, gets `ResidencyReady`
        self._timer: Timer | None = None
        self._rows_due: dict[str, SessionView] = {}  # rows to show at the next tick
        self._residency_due: dict[str, Residency] = {}  # residencies to show at the next tick
        self._residency_busy = False
        self._residency_all_at = 0.0
        self._note_at = 0.0
        self._meters_at = 0.0

    def start(self) -> None:
        """Tick from now on, and show the meters at once."""
        self._timer = self.host.set_interval(1 / FLUSH_HZ, self.tick, name="tick")
        self.tick_meters()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def row_due(self, view: SessionView) -> None:
        """Show `view` in its session's row at the next tick: its repaint then shares the
        tick's screen update instead of costing one of its own."""
        due = self._rows_due.get(view.id)
        if due is None or due.taken < view.taken:
            self._rows_due[view.id] = view

    async def tick(self) -> None:
        """`FLUSH_HZ`: rows that changed, the meters when their turn came, then the text.

        Everything a tick touches is repainted in one screen update; each update costs a
        few ms of the UI thread whatever it repaints.
        """
        if self._rows_due:
            due, self._rows_due = self._rows_due, {}
            for view in due.values():
                self.sessions.show_view(view)
        if self._residency_due:
            due_residency, self._residency_due = self._residency_due, {}
            rows = self.sidebar.rows()
            for session_id, residency in due_residency.items():
                if session_id in rows:
                    rows[session_id].set_residency(residency)
        if time.monotonic() - self._meters_at >= 1 / METERS_HZ:
            self.tick_meters()
        self.type_ahead.tick(self.sessions.current)
        await self.flush_replies()

    async def flush_replies(self) -> None:
        async with self.transcript_lock:
            await self.flush_unlocked()

    async def flush_unlocked(self) -> None:
        """Show the visible session's buffered text; drop hidden sessions' (a switch re-reads).

        The caller holds `transcript_lock`."""
        current = self.sessions.current
        chunks = self.buffer.take(current or "")
        if not chunks or current is None:
            return
        for chunk in chunks:
            if not await self.transcript.append(chunk):
                await self.sessions.sync_transcript(self.service.snapshot(current))
                await self.transcript.append(chunk)

    def tick_meters(self) -> None:
        """4 Hz: meters from a stats snapshot, busy sessions' rows, residency in a thread."""
        self._meters_at = time.monotonic()
        current = self.sessions.current
        for session_id, view in list(self.sessions.views.items()):
            if view.state != TurnState.IDLE or session_id == current:
                self.sessions.refresh_row(session_id)
        view = self.sessions.views.get(current) if current else None
        rate = self.buffer.session_rate(current) if current else None
        stats = self.service.engine.stats()
        self.meters.update_meters(stats, view, rate)
        legend = REMOTE_LEGEND if getattr(stats, "engine", None) else LEGEND
        if self.sidebar.border_subtitle != legend:
            self.sidebar.border_subtitle = legend
        now = time.monotonic()
        backend = self.backend()
        if backend.describe and now - self._note_at > NOTE_EVERY_S:
            self._note_at = now
            self.meters.set_cache_note(backend.describe())  # repaints only when it changed
        self.request_residency(all_sessions=now - self._residency_all_at > RESIDENCY_ALL_EVERY_S)

    def request_residency(self, *, all_sessions: bool) -> None:
        """Read where the sessions' pages live (all, or the busy and the shown one) in a
        thread; shown at the tick after `residency_ready`."""
        if self._residency_busy:
            return
        views = self.sessions.views
        if all_sessions:
            self._residency_all_at = time.monotonic()
            ids = list(views)
        else:
            current = self.sessions.current
            ids = [s for s, v in views.items() if v.state != TurnState.IDLE or s == current]
        if ids:
            self._residency_busy = True
            self.host.run_worker(
                lambda: self._compute_residency(ids),
                thread=True,
                exit_on_error=False,
                group="residency",
            )

    def _compute_residency(self, ids: list[str]) -> None:
        """Thread worker: may wait on the engine's lock."""
        out: dict[str, Residency] = {}
        try:
            for session_id in ids:
                try:
                    out[session_id] = self.service.residency(session_id)
                except KvchatError:
                    continue  # deleted meanwhile
        finally:
            self.host.post_message(ResidencyReady(out))

    def residency_ready(self, residencies: dict[str, Residency]) -> None:
        self._residency_busy = False
        self._residency_due.update(residencies)  # shown by the next tick
