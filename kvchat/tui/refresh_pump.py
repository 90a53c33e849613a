"""The app's refresh pump: what reaches the screen at `FLUSH_HZ`, and the meters at `METERS_HZ`.

One timer drives it: each tick repaints the rows whose sessions changed, the
residency bars computed meanwhile, the meters when their turn came, and the
visible session's buffered text, so that all of it shares one screen update (each
update costs the UI thread a millisecond or more whatever it repaints). Residency
is read in a thread worker: it waits on the engine's lock, the UI never does.
`RefreshPump` is mixed into `KvchatApp` and uses its service, sidebar, transcript
and meters.
"""

from __future__ import annotations

import time

from textual import work

from kvchat.chat.service import SessionService
from kvchat.chat.session import TurnState
from kvchat.engine.api import Residency
from kvchat.errors import KvchatError
from kvchat.tui.messages import ResidencyReady
from kvchat.tui.sidebar import LEGEND, REMOTE_LEGEND

FLUSH_HZ = 20
METERS_HZ = 4
RESIDENCY_ALL_EVERY_S = 5.0
NOTE_EVERY_S = 2.0  # the cache note (model, cache sizes, attention) is re-read this often


class RefreshPump:
    """The tick, the meters and residency of `KvchatApp` (see the module docstring)."""

    async def _tick(self) -> None:
        """`FLUSH_HZ`: rows that changed, the meters when their turn came, then the text.

        Everything a tick touches is repainted in one screen update; each update costs a
        few ms of the UI thread whatever it repaints.
        """
        if self._rows_due:
            due, self._rows_due = self._rows_due, set()
            for session_id in due:
                self._refresh_row(session_id)
        if self._residency_due:
            due_residency, self._residency_due = self._residency_due, {}
            rows = self.sidebar.rows()
            for session_id, residency in due_residency.items():
                if session_id in rows:
                    rows[session_id].set_residency(residency)
        if time.monotonic() - self._meters_at >= 1 / METERS_HZ:
            self._tick_meters()
        if self.draft_timer.pending:
            self._draft_if_due()
        if self._draft_label_shown != self._draft_label:  # "N tokens ready"
            self.composer.border_subtitle = self._draft_label_shown = self._draft_label
        await self._flush_replies()

    async def _flush_replies(self) -> None:
        async with self._transcript_lock:
            await self._flush_unlocked()

    async def _flush_unlocked(self) -> None:
        """Show the visible session's buffered text; drop hidden sessions' (a switch re-reads)."""
        chunks = self.buffer.take(self.current or "")
        if not chunks or self.service is None or self.current is None:
            return
        for chunk in chunks:
            if not await self.transcript.append(chunk):
                await self.transcript.sync(self.current, self.service.messages(self.current))
                await self.transcript.append(chunk)

    def _tick_meters(self) -> None:
        """4 Hz: meters from a stats snapshot, busy sessions' rows, residency in a thread."""
        service = self.service
        if service is None:
            return
        self._meters_at = time.monotonic()
        for session_id, view in list(self.views.items()):
            if view.state != TurnState.IDLE or session_id == self.current:
                self._refresh_row(session_id)
        view = self.views.get(self.current) if self.current else None
        rate = self.buffer.session_rate(self.current) if self.current else None
        stats = service.engine.stats()
        self.meters.update_meters(stats, view, rate)
        legend = REMOTE_LEGEND if getattr(stats, "engine", None) else LEGEND
        if self.sidebar.border_subtitle != legend:
            self.sidebar.border_subtitle = legend
        now = time.monotonic()
        backend = self.backend
        if backend is not None and backend.describe and now - self._note_at > NOTE_EVERY_S:
            self._note_at = now
            self.meters.set_cache_note(backend.describe())  # repaints only when it changed
        self._request_residency(all_sessions=now - self._residency_all_at > RESIDENCY_ALL_EVERY_S)

    def _request_residency(self, *, all_sessions: bool) -> None:
        if self._residency_busy or self.service is None:
            return
        if all_sessions:
            self._residency_all_at = time.monotonic()
            ids = list(self.views)
        else:
            ids = [
                s for s, v in self.views.items() if v.state != TurnState.IDLE or s == self.current
            ]
        if ids:
            self._residency_busy = True
            self._compute_residency(self.service, ids)

    @work(thread=True, exit_on_error=False, group="residency")
    def _compute_residency(self, service: SessionService, ids: list[str]) -> None:
        out: dict[str, Residency] = {}
        try:
            for session_id in ids:
                try:
                    out[session_id] = service.residency(session_id)
                except KvchatError:
                    continue  # deleted meanwhile
        finally:
            self.post_message(ResidencyReady(out))

    def on_residency_ready(self, message: ResidencyReady) -> None:
        self._residency_busy = False
        self._residency_due.update(message.residencies)  # shown by the next tick
