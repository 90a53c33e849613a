"""Which session is shown, the sessions listed, and moving between them.

A switch renders the chosen session at once from the service's snapshot and prefetches
its pages in a thread worker, so it never waits for the engine. Each session has its
own composer text (`UnsentText`): the one left keeps what was typed for it, the one
chosen gets its own back. Switching away ends the left session's type-ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from textual.widget import Widget

from kvchat.chat.service import SessionService
from kvchat.chat.session import SessionSnapshot, SessionView, TurnState
from kvchat.errors import KvchatError
from kvchat.tui.backend import TuiBackend
from kvchat.tui.composer import Composer
from kvchat.tui.sidebar import SessionList
from kvchat.tui.titles import NEW_TITLE
from kvchat.tui.transcript import Transcript
from kvchat.tui.type_ahead_sender import TypeAheadSender
from kvchat.tui.unsent_text import UnsentText


class SessionSwitcher:
    """The current session, the listed sessions' views, and switching between them."""

    def __init__(
        self,
        service: SessionService,
        *,
        sidebar: SessionList,
        transcript: Transcript,
        composer: Composer,
        unsent: UnsentText,
        type_ahead: TypeAheadSender,
        transcript_lock: asyncio.Lock,
        backend: Callable[[], TuiBackend],
        on_relisted: Callable[[], None],
        host: Widget,
    ) -> None:
        self.service = service
        self.sidebar = sidebar
        self.transcript = transcript
        self.composer = composer
        self.unsent = unsent
        self.type_ahead = type_ahead
        self.transcript_lock = transcript_lock  # the frame pump appends under it too
        self.backend = backend  # the one serving now (a model switch replaces it)
        self.on_relisted = on_relisted  # the sidebar was rebuilt (residency is read anew)
        self.host = host  # runs the thread workers, shows the notices
        self.current: str | None = None
        self.views: dict[str, SessionView] = {}
        self.show_archived = False
        self._told_model: set[str] = set()  # sessions told they were written by another model
        self.shown_taken = 0  # the `taken` of the snapshot the transcript shows

    # ------------------------------------------------------------------ the list

    def list_views(self) -> list[SessionView]:
        views = self.service.list_sessions(include_archived=self.show_archived)
        self.views = {v.id: v for v in views}
        return views

    async def refresh_sessions(self) -> None:
        """The set of sessions changed: rebuild the sidebar; keep the current one if it lives."""
        views = self.list_views()
        await self.sidebar.set_sessions(views)
        if self.current not in self.views:
            newest = max(self.views.values(), key=lambda v: (v.created, v.id), default=None)
            await self.switch_to(newest.id if newest is not None else None)
        else:
            self.sidebar.set_current(self.current)
        self.on_relisted()

    def refresh_row(self, session_id: str) -> None:
        """The session's row from the service's view now (the meters' tick)."""
        if session_id not in self.views:
            return
        try:
            view = self.service.session(session_id)
        except KvchatError:
            return
        self.show_view(view)

    def show_view(self, view: SessionView) -> None:
        """Show `view` in its session's row, unless the row already shows a newer one (events
        are published from more than one thread, so a view can arrive after a later one)."""
        held = self.views.get(view.id)
        if held is None or held.taken > view.taken:
            return
        self.views[view.id] = view
        self.sidebar.update_view(view)

    async def sync_transcript(self, snapshot: SessionSnapshot) -> None:
        """Bring the transcript up to `snapshot` of the current session, unless it shows a
        newer one already. The caller holds `transcript_lock`."""
        if snapshot.view.id != self.current or snapshot.taken < self.shown_taken:
            return
        self.shown_taken = snapshot.taken
        await self.transcript.sync(self.current, snapshot.messages)

    def title(self, session_id: str) -> str:
        view = self.views.get(session_id)
        return view.title if view else "a session"

    def update_title(self) -> None:
        view = self.views.get(self.current) if self.current else None
        if view is None and self.current:
            view = self.service.session(self.current)
        self.transcript.border_title = view.title if view else "kvchat"
        self.transcript.border_subtitle = view.notice if view and view.notice else None

    def require_current(self) -> str:
        if self.current is None:
            raise KvchatError("there is no session: press ctrl+n to start one")
        return self.current

    def busy(self) -> bool:
        """Whether a listed session has a reply on the way."""
        return any(v.state != TurnState.IDLE for v in self.views.values())

    # ---------------------------------------------------------------- switching

    async def switch_to(self, session_id: str | None) -> None:
        """Render the chosen session at once from the service's snapshot; prefetch in a thread.

        Each session has its own composer text: what was typed for the one left is kept
        with it (stored), and the chosen one's comes back."""
        leaving = self.current if self.current != session_id else None
        if leaving is not None:
            self.unsent.keep(leaving)
            self.type_ahead.leave(leaving)  # its pages stay cached
        self.current = session_id
        self.sidebar.set_current(session_id)
        self.composer.set_editing(False)
        if leaving is not None or not self.composer.message:
            self.composer.load_message(self.unsent.of(session_id))
            self.composer.move_cursor(self.composer.document.end)
            if self.composer.message:
                self.type_ahead.edited()  # computed ahead again
        async with self.transcript_lock:
            snapshot = self.service.snapshot(session_id) if session_id else None
            self.shown_taken = snapshot.taken if snapshot else 0
            await self.transcript.show(session_id, snapshot.messages if snapshot else [])
        self.update_title()
        if session_id is not None:
            self.host.run_worker(
                lambda: self._focus_session(session_id),
                thread=True,
                exit_on_error=False,
                group="focus",
            )
            self._say_whose_model(session_id)

    def _focus_session(self, session_id: str) -> None:
        """Thread worker: clears unread, tells the engine to prefetch the session's pages."""
        with contextlib.suppress(KvchatError):  # deleted meanwhile
            self.service.focus(session_id)

    def _say_whose_model(self, session_id: str) -> None:
        """A session written with another model than the running one says which, once a
        run: f5 switches to it, or it is no longer on this machine."""
        view = self.views.get(session_id)
        backend = self.backend()
        if (
            view is None
            or not view.model_name
            or not backend.model_name
            or view.model_name == backend.model_name
            or session_id in self._told_model
        ):
            return
        self._told_model.add(session_id)
        written_with, running = view.model_name, backend.model_name
        self.host.run_worker(
            lambda: self._check_model(backend, written_with, running),
            thread=True,
            exit_on_error=False,
            group="model-check",
        )

    def _check_model(self, backend: TuiBackend, written_with: str, running: str) -> None:
        """Thread worker: whether the session's model is still here reads the disk."""
        if backend.has_model(written_with):
            text = (
                f"This session was written with {written_with}; {running} runs now (f5 switches)."
            )
        else:
            text = (
                f"This session was written with {written_with}, which is no longer on this "
                f"machine; its next turn runs on {running}."
            )
        self.host.app.call_from_thread(self.host.notify, text, timeout=10)

    def step(self, delta: int) -> str | None:
        """The session `delta` rows away from the current one in the sidebar (wrapping)."""
        order = self.sidebar.order
        if not order:
            return None
        if self.current not in order:
            return order[0]
        return order[(order.index(self.current) + delta) % len(order)]

    def numbered(self, n: int) -> str | None:
        """The listed session numbered `n` (its number for life, not its row)."""
        return next((v.id for v in self.views.values() if v.number == n and not v.archived), None)

    # -------------------------------------------------------------- new sessions

    async def open_new_session(self) -> str:
        """Create a session, list it, and make it the current one."""
        session_id = self.service.create_session(NEW_TITLE)
        self.views[session_id] = self.service.session(session_id)
        await self.refresh_sessions()
        await self.switch_to(session_id)
        self.composer.focus()
        return session_id

    def empty_session(self) -> str | None:
        """A listed session with no message, nothing on the way and nothing typed for it:
        the current one if it is such, else the first in the list."""

        def empty(session_id: str) -> bool:
            view = self.service.session(session_id)
            typed = self.composer.message if session_id == self.current else view.unsent
            return (
                view.message_count == 0
                and view.state == TurnState.IDLE
                and not view.queued_says
                and not typed.strip()
            )

        order = self.sidebar.order
        if self.current in order and empty(self.current):
            return self.current
        return next((session_id for session_id in order if empty(session_id)), None)
