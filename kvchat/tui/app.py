"""`KvchatApp`: the Textual application over one `SessionService`.

Threads (harlequin's and toolong's rule): the engine and the service run on
their own threads and never touch a widget. Service events arrive on the
service's worker thread; reply text goes into a `StreamBuffer` and everything
else is posted to the UI as a `ServiceEvent` message. The UI drains the visible
session's text at 20 Hz (`FLUSH_HZ`, with a final flush when a reply ends) and
refreshes the meters from `engine.stats()` snapshots at most 4 times a second
(`METERS_HZ`), on the same timer, so that they share one screen update.

Why the UI's cost per tick matters: the engine thread runs each decode step's
Python (a few ms of it) under the same GIL as the UI thread, and on a small
machine the UI thread also takes a core from the model's matmuls, so UI time is
taken from generation. Nothing runs per token on the UI thread; hidden
sessions' text is only buffered; widgets repaint only when what they show
changed, without a screen layout unless their size changed (`repaint`). A
screen update costs the UI thread a millisecond or more whatever it repaints,
so `FLUSH_HZ` is the low end of what reads as smooth streaming (20-30 Hz).
Anything that can wait on the engine's lock (residency, prefetch) runs in a
thread worker, so a switch never waits for the engine.

The GIL's switch interval is 1 ms while the app runs (`GIL_SWITCH_INTERVAL_S`,
Python's default 5 ms restored at exit): between two torch ops the engine thread
needs the GIL back for microseconds of Python, and when the UI thread holds it in
a screen update the engine waits until the interval forces a hand-over (measured:
docs/tui.md).

A failed write to the session database shows `SaveBanner` until saving works again;
what is still unsaved at quit is written to a recovery file (`shutdown` keeps its
report in `unsaved`, `run_tui` prints it and exits 1).

The model loads in a thread worker behind `StartupScreen`; a `KvchatError`
from it shows `FailedStartScreen`. Every action catches `KvchatError` and shows
its message as a notification; anything else is logged to the error log and
reported in one line (`guarded`).

Its parts live beside it: the styles (`app.tcss`), the messages threads post
(`messages`), the refresh pump (`refresh_pump`) and the command palette
(`command_palette`). What stays here is one class on purpose: Textual's `App`,
whose start-up, event handlers and actions all act on the same current session,
service and widgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.command import SimpleCommand
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, TextArea

from kvchat.chat.attachments import Attachment, attach
from kvchat.chat.error_log import log_exception
from kvchat.chat.events import (
    ChatEvent,
    DraftChanged,
    ReplyDelta,
    ReplyFinished,
    ReplyStarted,
    SaveFailed,
    SaveRecovered,
    SessionArchived,
    SessionChanged,
    SessionCreated,
    SessionDeleted,
    SessionFailed,
    SessionNotice,
    SessionRenamed,
)
from kvchat.chat.recovery import UnsavedReport
from kvchat.chat.sampling_text import parse_sampling, sampling_text
from kvchat.chat.search import SearchHit
from kvchat.chat.service import RETRY_SAVE_S, SessionService
from kvchat.chat.session import MessageView, SessionView, TurnState
from kvchat.chat.settings import Settings, save_setting
from kvchat.chat.store import Store
from kvchat.engine.api import Residency
from kvchat.errors import KvchatError, UsageError
from kvchat.paths import app_paths
from kvchat.tui.attachment_chips import AttachmentChips
from kvchat.tui.backend import BackendFactory, TuiBackend
from kvchat.tui.command_palette import CommandPalette
from kvchat.tui.composer import Composer
from kvchat.tui.guarded import guarded, log_failure, notify_failure
from kvchat.tui.keys import (
    APP_KEYS,
    bindings,
    check_keymap,
    install_meta_digit_keys,
    keys_for,
)
from kvchat.tui.messages import (
    BackendReady,
    BackendSwitched,
    ModelsListed,
    SendFailed,
    ServiceEvent,
    StartFailed,
    StartProgress,
)
from kvchat.tui.meters import Meters
from kvchat.tui.model_picker import ModelPicker
from kvchat.tui.refresh_pump import FLUSH_HZ, RefreshPump
from kvchat.tui.save_banner import SaveBanner
from kvchat.tui.screens import (
    FailedStartScreen,
    HelpScreen,
    StartupScreen,
    TextDialog,
)
from kvchat.tui.session_search import SessionSearch
from kvchat.tui.sidebar import SessionList, SessionRow
from kvchat.tui.stream_buffer import StreamBuffer
from kvchat.tui.themes import DEFAULT_THEME, PanelBorderVariable, load_themes
from kvchat.tui.transcript import Transcript
from kvchat.tui.type_ahead import DraftTimer, ready_label

GIL_SWITCH_INTERVAL_S = 0.001  # while the app runs (see the module docstring)
NEW_TITLE = "New chat"
_APP_ACTIONS = frozenset(spec.action.split("(")[0] for spec in APP_KEYS)


class KvchatApp(PanelBorderVariable, RefreshPump, CommandPalette, App[int]):
    """Sessions, transcript, input and meters over one chat service (see the module docstring)."""

    CSS_PATH = Path(__file__).parent / "app.tcss"
    TITLE = "kvchat"
    COMMANDS = App.COMMANDS | {SessionSearch}  # the palette also finds sessions
    BINDINGS = bindings(APP_KEYS, priority=True)  # over the text area's own f6, ctrl+pageup…
    # below 120 columns the meters give their room to the transcript; below 90 the sidebar too
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [
        (0, "-narrow"),
        (90, "-medium"),
        (120, "-wide"),
    ]
    ENABLE_COMMAND_PALETTE = True
    COMMAND_PALETTE_BINDING = "ctrl+backslash"  # ours has an id (command_palette)

    def __init__(
        self,
        backend_factory: BackendFactory,
        *,
        settings: Settings | None = None,
        settings_problem: str | None = None,
        store_factory: Callable[[], Store] | None = None,
        user_themes_dir: Path | None = None,
    ) -> None:
        super().__init__()
        install_meta_digit_keys()  # alt+1..9 in tmux and screen (see the function)
        self._switch_interval_before = sys.getswitchinterval()  # restored at unmount
        self.settings = settings or Settings()
        self.backend_factory = backend_factory
        self.store_factory = store_factory or (lambda: Store(app_paths().database))
        self.user_themes_dir = (
            user_themes_dir if user_themes_dir is not None else app_paths().themes_dir
        )
        self.problems: list[str] = [settings_problem] if settings_problem else []
        self.keymap, key_problems = check_keymap(self.settings.keys, self.settings.sources)
        self.problems += key_problems
        self.set_keymap(self.keymap)
        self.backend: TuiBackend | None = None
        self.service: SessionService | None = None
        self._told_model: set[str] = set()  # sessions told they were written by another model
        self.serving = False  # True once start-up is over: sessions listed, the composer focused
        self.current: str | None = None
        self.buffer = StreamBuffer()
        self.draft_timer = DraftTimer()  # when the composer's text is computed ahead
        self._draft_label: str | None = None  # the composer's "N tokens ready", set at a tick
        self._draft_label_shown: str | None = None  # (the border keeps it as Content, not str)
        self.undo_stack: list[tuple[str, str]] = []  # (archive|delete, session id)
        self._attachment_tokens: dict[str, int] = {}  # by block: a chip's count, once known
        self.show_archived = False
        self.views: dict[str, SessionView] = {}
        self._unsubscribe: Callable[[], None] | None = None
        self._transcript_lock = asyncio.Lock()
        self._residency_busy = False
        self._residency_all_at = 0.0
        self._note_at = 0.0
        self._meters_at = 0.0
        self._rows_due: set[str] = set()  # rows to refresh at the next tick
        self._residency_due: dict[str, Residency] = {}  # residencies to show at the next tick
        self._themes_ready = False
        self.exit_code = 0
        self.unsaved: UnsavedReport | None = None  # what `shutdown` could not store
        # one thread sends the composer's messages, in order: a say may wait on a server
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-send")
        self._load_themes()

    # ------------------------------------------------------------------ layout

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Our keys are priority bindings: off while a dialog or another screen is up."""
        if action in _APP_ACTIONS and action != "quit":
            return self.screen is self.screen_stack[0]
        return True

    def compose(self) -> ComposeResult:
        # kept as attributes: a dialog on top must not hide them from the timers
        self.sidebar = SessionList(id="sidebar")
        self.transcript = Transcript(
            retry_key=keys_for("regenerate", self.keymap).split(",")[0], id="transcript"
        )
        self.composer = Composer(keymap=self.keymap, id="composer")
        self.attachment_chips = AttachmentChips(id="attachments")
        self.meters = Meters(id="meters")
        self.save_banner = SaveBanner(id="save-banner")
        with Horizontal(id="body"):
            yield self.sidebar
            with Vertical(id="main"):
                yield self.save_banner
                yield self.transcript
                # in a box of its own: a screen update inside the transcript then repaints
                # the box, not the text area (which restyles itself on every repaint)
                with Vertical(id="composer-box"):
                    yield self.attachment_chips
                    yield self.composer
            yield self.meters
        yield Footer(compact=True)  # every shown key fits in 100 columns

    # ---------------------------------------------------------------- themes

    def _load_themes(self) -> None:
        loaded = load_themes(self.user_themes_dir)
        for theme in loaded.themes:
            self.register_theme(theme)
        self.problems += [f"Theme not loaded: {p}" for p in loaded.problems]
        wanted = self.settings.theme or DEFAULT_THEME
        if wanted not in self.available_themes:
            where = self.settings.sources.get("theme", "the settings file")
            kvchat_themes = ", ".join(t.name for t in loaded.themes)
            self.problems.append(
                f"Theme {wanted!r} ({where}) is not installed; using {DEFAULT_THEME}. "
                f"kvchat's themes: {kvchat_themes} (ctrl+p lists Textual's too)."
            )
            wanted = DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted

    def _theme_changed(self, theme: Any) -> None:
        if not self._themes_ready or theme.name == (self.settings.theme or DEFAULT_THEME):
            return
        try:
            save_setting("theme", theme.name)
            self.settings = replace(self.settings, theme=theme.name)
        except KvchatError as exc:
            self.notify(f"The theme is not saved: {exc}", severity="warning")

    # --------------------------------------------------------------- start-up

    def on_mount(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self._themes_ready = True
        for problem in self.problems:
            self.notify(problem, severity="warning", timeout=10)
        self.push_screen(StartupScreen(self.keymap))
        self._start()

    @work(thread=True, exit_on_error=False, group="startup")
    def _start(self) -> None:
        """Thread worker: load the model, open the store, build the service."""
        backend: TuiBackend | None = None
        try:
            backend = self.backend_factory(lambda line: self.post_message(StartProgress(line)))
            store = self.store_factory()
            chat = backend.chat
            service = SessionService(chat.engine, chat.renderer, store, **backend.service_options())
        except KvchatError as exc:
            self._close_backend(backend)
            self.post_message(StartFailed(str(exc), 2 if isinstance(exc, UsageError) else 1))
            return
        except Exception as exc:
            log_exception("kvchat could not start")
            self._close_backend(backend)
            self.post_message(
                StartFailed(
                    f"An unexpected error stopped the start: {exc}\n\n"
                    f"The details are in {app_paths().error_log}; "
                    "please include them in a bug report."
                )
            )
            return
        self.post_message(BackendReady(backend, service, store.interrupted_on_open))

    @staticmethod
    def _close_backend(backend: TuiBackend | None) -> None:
        if backend is not None:
            try:
                backend.close()
            except Exception:
                log_exception("closing the engine after a failed start")

    def on_start_progress(self, message: StartProgress) -> None:
        if isinstance(self.screen, StartupScreen):
            self.screen.progress(message.line)

    def on_start_failed(self, message: StartFailed) -> None:
        self.exit_code = message.exit_code
        text = message.text
        draft = self.screen.draft if isinstance(self.screen, StartupScreen) else ""
        if draft.strip():  # shown, so that it can be copied: nothing typed is lost
            text += f"\n\nWhat you typed while kvchat was starting (not sent):\n{draft}"
        self._switch_screen_to(FailedStartScreen(text))

    def _switch_screen_to(self, screen: Screen) -> None:
        if isinstance(self.screen, StartupScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)

    async def on_backend_ready(self, message: BackendReady) -> None:
        self.backend = message.backend
        self.service = message.service
        self._unsubscribe = self.service.subscribe(self._from_service)
        draft, send_draft = "", False
        if isinstance(self.screen, StartupScreen):
            draft, send_draft = self.screen.draft, self.screen.send_queued
            self.pop_screen()
        # Focus first: what a user types while the sessions are listed must reach the composer.
        self.composer.focus()
        self.meters.set_cache_note(message.backend.description)
        for notice in message.backend.notices:
            self.notify(notice, severity="warning", timeout=20)
        views = self._list_views()
        await self.sidebar.set_sessions(views)
        recent = max(views, key=lambda v: v.updated, default=None)
        typed = draft + self.composer.text  # while starting, then while the list was built
        self.composer.clear()
        await self.switch_to(recent.id if recent else None)  # its unsent text comes back
        unsent = self.composer.text
        # never sent with, nor instead of, what was kept from before
        if send_draft and self.composer.message:
            send_draft = False
            self.notify("Not sent yet: the session had unsent text; both are in the box.")
        if typed:  # what was typed while starting goes after the session's unsent text
            self.composer.load_text("\n".join(t for t in (unsent, typed) if t))
        self.composer.move_cursor(self.composer.document.end)
        if message.interrupted:
            self.notify(
                f"{message.interrupted} repl{'y was' if message.interrupted == 1 else 'ies were'} "
                "cut when kvchat last stopped; kept and marked interrupted.",
                severity="warning",
            )
        self.set_interval(1 / FLUSH_HZ, self._tick, name="tick")
        self._tick_meters()
        self.serving = True
        if send_draft:
            self.composer.action_send()  # to the session shown, as if sent just now

    async def on_unmount(self) -> None:
        self.shutdown()
        sys.setswitchinterval(self._switch_interval_before)

    def shutdown(self) -> None:
        """Stop listening, close the service (writes pending text) and the engine."""
        self._sender.shutdown(wait=True)  # a message sent just before quitting is stored
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self.service is not None:
            self._keep_unsent(self.current)
            try:
                self.unsaved = self.service.close()
            except Exception:
                log_exception("closing the session service")
            if self.unsaved is not None:
                self.exit_code = 1
            self.service = None
        self._close_backend(self.backend)
        self.backend = None

    # ---------------------------------------------------------- service events

    def _from_service(self, event: ChatEvent) -> None:
        """Service worker thread: buffer text, post the rest; never touch a widget."""
        if isinstance(event, ReplyDelta):
            self.buffer.add(event.session_id, event.message_id, event.text, len(event.token_ids))
        else:
            self.post_message(ServiceEvent(event))

    @guarded
    async def on_service_event(self, message: ServiceEvent) -> None:
        event = message.event
        service = self.service
        if service is None:
            return
        if isinstance(event, DraftChanged):
            # shown at the next tick: a draft beside streams moves every step, and each
            # change of the border repaints the text area
            if event.session_id == self.current:
                self._draft_label = ready_label(event.ready_tokens, event.total_tokens)
            return
        if isinstance(event, SaveFailed):
            self.save_banner.show_failure(event.error, event.unsaved_messages, RETRY_SAVE_S)
            return
        if isinstance(event, SaveRecovered):
            self.save_banner.clear_failure()
            self.notify("Saving works again: every message is stored.")
            return
        if isinstance(event, ReplyFinished):
            self.meters.turn_finished(event.session_id)  # its figures are this run's
        if isinstance(event, SessionCreated | SessionArchived | SessionDeleted):
            await self.refresh_sessions()
            return
        if isinstance(event, SessionFailed):
            self.notify(f"{self._title(event.session_id)}: {event.message}", severity="error")
        if isinstance(event, SessionNotice) and event.session_id == self.current:
            self.notify(event.text)
        if event.session_id != self.current:
            # another session's row waits for the next tick: its repaint then shares the
            # tick's screen update instead of costing one of its own
            self._rows_due.add(event.session_id)
            return
        self._refresh_row(event.session_id)
        if isinstance(event, ReplyStarted | ReplyFinished | SessionChanged | SessionRenamed):
            async with self._transcript_lock:
                if isinstance(event, ReplyFinished):
                    await self._flush_unlocked()  # the final flush: no token is lost
                await self.transcript.sync(self.current, service.messages(self.current))
            if isinstance(event, ReplyFinished):
                self.buffer.finish(event.message_id)
            self._update_title()
            if isinstance(event, ReplyFinished):
                self._tick_meters()

    def _title(self, session_id: str) -> str:
        view = self.views.get(session_id)
        return view.title if view else "a session"

    def _list_views(self) -> list[SessionView]:
        assert self.service is not None
        views = self.service.list_sessions(include_archived=self.show_archived)
        self.views = {v.id: v for v in views}
        return views

    async def refresh_sessions(self) -> None:
        """The set of sessions changed: rebuild the sidebar; keep the current one if it lives."""
        views = self._list_views()
        await self.sidebar.set_sessions(views)
        if self.current not in self.views:
            newest = max(self.views.values(), key=lambda v: (v.created, v.id), default=None)
            await self.switch_to(newest.id if newest is not None else None)
        else:
            self.sidebar.set_current(self.current)
        self._request_residency(all_sessions=True)

    def _refresh_row(self, session_id: str) -> None:
        if self.service is None or session_id not in self.views:
            return
        try:
            view = self.service.session(session_id)
        except KvchatError:
            return
        self.views[session_id] = view
        self.sidebar.update_view(view)

    # -------------------------------------------------------------- switching

    async def switch_to(self, session_id: str | None) -> None:
        """Render the chosen session at once from the service's snapshot; prefetch in a thread.

        Each session has its own composer text: what was typed for the one left is kept
        with it (stored), and the chosen one's comes back."""
        leaving = self.current if self.current != session_id else None
        if leaving is not None and self.service is not None:
            self._keep_unsent(leaving)
            self._end_draft(self.service, leaving)  # its pages stay cached
            self._draft_label = None
            self.draft_timer.reset()
        self.current = session_id
        self.sidebar.set_current(session_id)
        self.composer.set_editing(False)
        if leaving is not None or not self.composer.message:
            self.composer.load_message(self._unsent_of(session_id))
            self.composer.move_cursor(self.composer.document.end)
            if self.composer.message:
                self.draft_timer.edited(time.monotonic())  # computed ahead again
        async with self._transcript_lock:
            messages = self.service.messages(session_id) if self.service and session_id else []
            await self.transcript.show(session_id, messages)
        self._update_title()
        if session_id is not None and self.service is not None:
            self._focus_session(self.service, session_id)
            self._say_whose_model(session_id)

    def _say_whose_model(self, session_id: str) -> None:
        """A session written with another model than the running one says which, once a
        run: f5 switches to it, or it is no longer on this machine."""
        view = self.views.get(session_id)
        backend = self.backend
        if (
            view is None
            or backend is None
            or not view.model_name
            or not backend.model_name
            or view.model_name == backend.model_name
            or session_id in self._told_model
        ):
            return
        self._told_model.add(session_id)
        self._check_model(backend, view.model_name, backend.model_name)

    @work(thread=True, exit_on_error=False, group="model-check")
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
        self.call_from_thread(self.notify, text, timeout=10)

    def _keep_unsent(self, session_id: str | None) -> None:
        """Store the composer's text as `session_id`'s unsent text (not while it holds a
        message being edited: that one is still stored as sent)."""
        if self.service is None or session_id is None or self.composer.editing:
            return
        with contextlib.suppress(KvchatError):  # deleted meanwhile
            self.service.keep_unsent(session_id, self.composer.message)

    def _unsent_of(self, session_id: str | None) -> str:
        if self.service is None or session_id is None:
            return ""
        try:
            return self.service.session(session_id).unsent
        except KvchatError:
            return ""

    @work(thread=True, exit_on_error=False, group="focus")
    def _focus_session(self, service: SessionService, session_id: str) -> None:
        with contextlib.suppress(KvchatError):  # deleted meanwhile
            service.focus(session_id)  # clears unread, tells the engine to prefetch its pages

    # ------------------------------------------------------------- type-ahead

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area is self.composer:
            self.draft_timer.edited(time.monotonic())

    def _draft_if_due(self) -> None:
        """The composer's text as the current session's draft, once typing paused (or grew)."""
        if self.service is None or self.current is None or self.composer.editing:
            return
        text = self.composer.message
        if self.draft_timer.due(time.monotonic(), len(text)):
            self._keep_unsent(self.current)  # here, in typing order: never after a send
            self._send_draft(self.service, self.current, text.strip())

    @work(thread=True, exit_on_error=False, group="draft")
    def _send_draft(self, service: SessionService, session_id: str, text: str) -> None:
        # rendering and tokenizing a pasted document takes milliseconds: not on the UI thread
        with contextlib.suppress(KvchatError):  # deleted meanwhile
            service.draft(session_id, text)

    @work(thread=True, exit_on_error=False, group="draft")
    def _end_draft(self, service: SessionService, session_id: str) -> None:
        with contextlib.suppress(KvchatError):
            service.end_draft(session_id)

    def _update_title(self) -> None:
        view = self.views.get(self.current) if self.current else None
        if view is None and self.current and self.service is not None:
            view = self.service.session(self.current)
        self.transcript.border_title = view.title if view else "kvchat"
        self.transcript.border_subtitle = view.notice if view and view.notice else None

    def _require_current(self) -> str:
        if self.current is None or self.service is None:
            raise KvchatError("there is no session: press ctrl+n to start one")
        return self.current

    @guarded
    async def open_search_hit(self, hit: SearchHit) -> None:
        """The palette's search result: its session, scrolled to the message found."""
        await self.switch_to(hit.session_id)
        if hit.message_id is not None and not self.transcript.show_message(hit.message_id):
            self.notify(
                "Found in an earlier message than the transcript shows; export the session "
                "(ctrl+p, Export to Markdown) to read it."
            )

    def on_session_row_selected(self, message: SessionRow.Selected) -> None:
        self.run_worker(self.switch_to(message.session_id), group="switch")

    # ---------------------------------------------------------------- sending

    @guarded
    async def on_composer_submitted(self, message: Composer.Submitted) -> None:
        if self.service is None:
            return
        if self.current is None:
            await self.action_new_session()
        session_id = self._require_current()
        text = message.text
        editing = self.composer.editing
        view = self.views.get(session_id)
        retitle = not editing and view is not None and view.title == NEW_TITLE
        if editing:
            self.composer.set_editing(False)
        else:
            self.draft_timer.reset()
        self.composer.clear()
        # sizing the turn may ask a server (/tokenize): on the sender thread, in send order
        self._sender.submit(self._send, self.service, session_id, text, editing, retitle)

    def _send(
        self, service: SessionService, session_id: str, text: str, editing: bool, retitle: bool
    ) -> None:
        """Sender thread: say `text` (or edit and resend); a refusal gives the text back."""
        try:
            if editing:
                service.edit_last_user_message(session_id, text)
            else:
                service.say(session_id, text)  # ends the session's draft, keeping its pages
                if retitle:
                    service.rename(session_id, _title_from(text))
        except Exception as exc:
            log_failure(exc, "send")
            # posted, not called: `shutdown` may be waiting for this thread on the UI thread
            self.post_message(SendFailed(text, editing, exc))

    def on_send_failed(self, message: SendFailed) -> None:
        if not self.composer.message:  # nothing typed since: the message is back to fix
            self.composer.load_message(message.text)
            self.composer.set_editing(message.editing)
        notify_failure(self, message.error)

    # ---------------------------------------------------------------- actions

    @guarded
    async def action_new_session(self) -> None:
        """A session to type into: an empty one already listed (the current one first)
        when there is one, so pressing the key again does not pile up empty "New chat"
        rows; else a new one."""
        if self.service is None:
            return
        empty = self._empty_session()
        if empty is None:
            await self.open_new_session()
            return
        if empty != self.current:
            await self.switch_to(empty)
        self.composer.focus()

    async def open_new_session(self) -> str:
        """Create a session, list it, and make it the current one."""
        assert self.service is not None
        session_id = self.service.create_session(NEW_TITLE)
        self.views[session_id] = self.service.session(session_id)
        await self.refresh_sessions()
        await self.switch_to(session_id)
        self.composer.focus()
        return session_id

    def _empty_session(self) -> str | None:
        """A listed session with no message, nothing on the way and nothing typed for it:
        the current one if it is such, else the first in the list."""
        assert self.service is not None

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

    def _step(self, delta: int) -> str | None:
        order = self.sidebar.order
        if not order:
            return None
        if self.current not in order:
            return order[0]
        return order[(order.index(self.current) + delta) % len(order)]

    @guarded
    async def action_previous_session(self) -> None:
        target = self._step(-1)
        if target is not None and target != self.current:
            await self.switch_to(target)

    @guarded
    async def action_next_session(self) -> None:
        target = self._step(+1)
        if target is not None and target != self.current:
            await self.switch_to(target)

    @guarded
    async def action_jump(self, n: int) -> None:
        """alt+N: the session numbered N (its number for life, not its row)."""
        target = next((v.id for v in self.views.values() if v.number == n and not v.archived), None)
        if target is not None and target != self.current:
            await self.switch_to(target)

    def action_scroll_transcript(self, pages: int) -> None:
        """pageup / pagedown: a page of the transcript, the composer keeping the focus
        (scrolled to the end, the transcript follows the reply again)."""
        transcript = self.transcript
        if pages < 0:
            transcript.scroll_page_up(animate=False)
        else:
            transcript.scroll_page_down(animate=False)

    def action_scroll_transcript_to(self, end: int) -> None:
        """ctrl+home / ctrl+end: the transcript's first message, or its end."""
        if end:
            self.transcript.scroll_end(animate=False)
        else:
            self.transcript.scroll_home(animate=False)

    @guarded
    def action_stop(self) -> None:
        if self.composer.editing:
            self.composer.set_editing(False)
            self.composer.clear()
            return
        if self.current is not None and self.service is not None:
            self.service.stop(self.current)

    @guarded
    def action_regenerate(self) -> None:
        self.service.regenerate(self._require_current())  # type: ignore[union-attr]

    @guarded
    def action_edit_resend(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        users = [m for m in self.service.messages(session_id) if m.role == "user"]
        if not users:
            raise KvchatError("there is no message of yours to edit")
        self.composer.load_message(users[-1].content)
        self.composer.set_editing(True)
        self.composer.focus()

    # ---------------------------------------------------------------- models

    @guarded
    def action_switch_model(self) -> None:
        """f5: the models on this machine; the one chosen serves every later turn."""
        if self.backend is None or self.service is None:
            return
        if self.backend.switch is None:
            self.notify(
                "This engine serves its own model (a remote server): restart kvchat with "
                "--model to run another.",
                severity="warning",
            )
            return
        self._list_models(self.backend)

    @work(thread=True, exit_on_error=False, group="models")
    def _list_models(self, backend: TuiBackend) -> None:
        try:
            choices = backend.models()
        except Exception as exc:
            log_failure(exc, "listing the models")
            self.call_from_thread(notify_failure, self, exc)
            return
        self.post_message(ModelsListed(choices))

    def on_models_listed(self, message: ModelsListed) -> None:
        if not message.choices:
            self.notify("No models found on this machine besides the one running.")
            return
        self.push_screen(ModelPicker(message.choices), self._model_chosen)

    def _model_chosen(self, name: str | None) -> None:
        if name is None or self.backend is None or self.service is None:
            return
        busy = [v for v in self.views.values() if v.state != TurnState.IDLE]
        if busy:
            self.notify(
                "A reply is on the way: let it finish (or stop it with esc), then switch.",
                severity="warning",
            )
            return
        self.notify(f"Loading {name}… (the current model serves until it is ready)")
        self._switch_model(self.backend, self.service, name)

    @work(thread=True, exit_on_error=False, group="switch-model", exclusive=True)
    def _switch_model(self, old: TuiBackend, service: SessionService, name: str) -> None:
        """Thread worker: load `name`'s backend beside the running one, hand the sessions
        to it, then close the old one (a failure leaves the old one serving)."""
        assert old.switch is not None
        new: TuiBackend | None = None
        try:
            new = old.switch(name, lambda _line: None)
            service.replace_backend(new.chat.engine, new.chat.renderer, **new.service_options())
        except Exception as exc:
            self._close_backend(new)
            if not isinstance(exc, KvchatError):
                log_failure(exc, "switching the model")
            self.call_from_thread(
                self.notify, f"Could not switch to {name}: {exc}", severity="error", timeout=15
            )
            return
        self._close_backend(old)
        self.post_message(BackendSwitched(new, name))

    def on_backend_switched(self, message: BackendSwitched) -> None:
        self.backend = message.backend
        self.meters.set_cache_note(message.backend.description)
        self.notify(f"Now running {message.name}: every new turn uses it.")

    @guarded
    def action_rename(self) -> None:
        session_id = self._require_current()
        view = self.views[session_id]

        def done(title: str | None) -> None:
            if title and title.strip() and self.service is not None:
                self.service.rename(session_id, title.strip())
                self._update_title()

        self.push_screen(TextDialog("Rename the session", view.title), done)

    @guarded
    def action_archive(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        archived = self.views[session_id].archived
        self.service.set_archived(session_id, not archived)
        if not archived:
            self.undo_stack.append(("archive", session_id))
            self.notify(
                f"Archived “{self._title(session_id)}”. "
                f"{keys_for('undo', self.keymap)} brings it back."
            )

    @guarded
    def action_delete(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        self.service.delete(session_id)
        self.undo_stack.append(("delete", session_id))
        self.notify(
            f"Deleted “{self._title(session_id)}”. {keys_for('undo', self.keymap)} brings it "
            "back (until kvchat restarts)."
        )

    @guarded
    async def action_undo(self) -> None:
        if not self.undo_stack or self.service is None:
            raise KvchatError("nothing to undo")
        kind, session_id = self.undo_stack.pop()
        if kind == "archive":
            self.service.set_archived(session_id, False)
        else:
            self.service.undo_delete(session_id)
        await self.refresh_sessions()
        await self.switch_to(session_id)

    @guarded
    def action_copy_reply(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        replies = [m for m in self.service.messages(session_id) if m.role == "assistant"]
        if not replies or not replies[-1].content:
            raise KvchatError("there is no reply to copy yet")
        self.copy_to_clipboard(replies[-1].content)
        self.notify("Copied the last reply to the clipboard.")

    @guarded
    def action_attach(self) -> None:
        def done(path_text: str | None) -> None:
            if path_text and path_text.strip():
                self.attach_file(Path(path_text.strip()).expanduser())

        self.push_screen(
            TextDialog(
                "Attach a file's text to your message",
                hint="a path (relative to the folder kvchat started in); enter attaches",
            ),
            done,
        )

    @guarded
    def attach_file(self, path: Path) -> None:
        attachment = attach(path)
        composer = self.composer
        composer.attach(attachment)
        composer.focus()
        if self.service is None or self.current is None:
            self.notify(f"Attached {path.name}; type your question and press enter.")
            return
        self._attachment_tokens[attachment.block] = self._tokens_of(self.current, attachment)
        tokens, room = self.service.message_size(self.current, composer.message)
        if tokens > room:
            self.notify(
                f"Attached {path.name}: the message is now {tokens:,} tokens, "
                f"{tokens - room:,} more than a prompt can hold ({room:,}: the model's "
                "context less the reply's room). Cut the file's text before sending.",
                severity="warning",
                timeout=15,
            )
        else:
            self.notify(
                f"Attached {path.name}: the message is {tokens:,} tokens of the {room:,} a "
                "prompt can hold; type your question and press enter."
            )

    def _tokens_of(self, session_id: str, attachment: Attachment) -> int:
        """The tokens `attachment` adds to a message (its text less the template's own)."""
        assert self.service is not None
        alone, _ = self.service.message_size(session_id, attachment.block)
        empty, _ = self.service.message_size(session_id, "")
        return alone - empty

    async def on_composer_attachments_changed(self, message: Composer.AttachmentsChanged) -> None:
        attachments = self.composer.attachments
        await self.attachment_chips.show(attachments, self._attachment_tokens)
        self.draft_timer.edited(time.monotonic())  # the message changed: computed ahead anew
        unknown = [a for a in attachments if a.block not in self._attachment_tokens]
        if unknown and self.current is not None and self.service is not None:
            self._count_attachments(self.current, unknown)

    @work(thread=True, exit_on_error=False, group="count")
    def _count_attachments(self, session_id: str, attachments: list[Attachment]) -> None:
        """Token counts for chips loaded with a stored message (tokenizing a long file
        takes a while: not on the UI thread)."""
        with contextlib.suppress(KvchatError):
            counts = {a.block: self._tokens_of(session_id, a) for a in attachments}
            self.call_from_thread(self._counted, counts)

    async def _counted(self, counts: dict[str, int]) -> None:
        self._attachment_tokens.update(counts)
        await self.attachment_chips.show(self.composer.attachments, self._attachment_tokens)

    def on_attachment_chips_remove_requested(
        self, message: AttachmentChips.RemoveRequested
    ) -> None:
        self.composer.detach(message.index)
        self.composer.focus()

    @guarded
    def action_export(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        default = f"{_slug(self._title(session_id))}.md"

        def done(path_text: str | None) -> None:
            if not path_text or self.service is None:
                return
            path = Path(path_text.strip()).expanduser()
            try:
                path.write_text(self.service.export_markdown(session_id), encoding="utf-8")
            except OSError as exc:
                self.notify(f"Cannot write {path}: {exc.strerror or exc}", severity="error")
                return
            self.notify(f"Exported to {path.resolve()}")

        self.push_screen(TextDialog("Export the session as Markdown to", default), done)

    @guarded
    def action_fork(self) -> None:
        session_id = self._require_current()
        assert self.service is not None
        messages = self.service.messages(session_id)
        commands: list[SimpleCommand] = [
            SimpleCommand(
                f"Fork before message {m.index + 1}: {_preview(m)}",
                functools.partial(self.fork_at, session_id, m.index),
                "a new session with the messages before this one (shares their cache)",
            )
            for m in reversed(messages)
            if m.role == "user"
        ]
        if self.views[session_id].state == TurnState.IDLE:
            commands.insert(
                0,
                SimpleCommand(
                    "Fork at the end",
                    functools.partial(self.fork_at, session_id, len(messages)),
                    "a copy of the whole session",
                ),
            )
        if not commands:
            raise KvchatError("nothing to fork yet")
        self.search_commands(commands, placeholder="Fork the session at…")

    @guarded
    async def fork_at(self, session_id: str, index: int) -> None:
        assert self.service is not None
        new_id = self.service.fork(session_id, index)
        self.views[new_id] = self.service.session(new_id)
        await self.refresh_sessions()
        await self.switch_to(new_id)

    @guarded
    def action_system_prompt(self) -> None:
        session_id = self._require_current()
        view = self.views[session_id]

        def done(text: str | None) -> None:
            if text is not None and self.service is not None:
                try:
                    self.service.set_system_prompt(session_id, text.strip() or None)
                except KvchatError as exc:
                    self.notify(str(exc), severity="error")

        self.push_screen(
            TextDialog(
                "System prompt (empty removes it)", view.system_prompt or "", multiline=True
            ),
            done,
        )

    @guarded
    def action_sampling(self) -> None:
        session_id = self._require_current()
        view = self.views[session_id]

        def done(text: str | None) -> None:
            if not text or self.service is None:
                return
            try:
                sampling, max_tokens = parse_sampling(text, view.sampling, view.max_tokens)
            except KvchatError as exc:
                self.notify(str(exc), severity="error")
                return
            self.service.set_sampling(session_id, sampling, max_tokens)
            self.notify("Sampling parameters set for this session's next turns.")

        self.push_screen(
            TextDialog("Sampling for this session", sampling_text(view.sampling, view.max_tokens)),
            done,
        )

    async def action_toggle_archived(self) -> None:
        self.show_archived = not self.show_archived
        await self.refresh_sessions()
        self.notify("Showing archived sessions." if self.show_archived else "Hiding archived ones.")

    def action_theme(self) -> None:
        self.action_change_theme()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap))

    def action_toggle_meters(self) -> None:
        """Show or hide the meters. Under 120 columns they are hidden to begin with, and
        shown they take the sidebar's place (the transcript keeps its width)."""
        self.screen.toggle_class("-meters-toggled")

    async def action_quit(self) -> None:
        self.exit(self.exit_code, return_code=self.exit_code)


def _title_from(text: str) -> str:
    first = next((line.strip() for line in text.splitlines() if line.strip()), NEW_TITLE)
    return first if len(first) <= 32 else first[:31] + "…"


def _preview(message: MessageView) -> str:
    text = " ".join(message.content.split())
    return text if len(text) <= 50 else text[:49] + "…"


def _slug(title: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug or "session"
