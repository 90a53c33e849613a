"""`ChatScreen`: sessions, transcript, composer and meters over one chat service.

The screen the app shows once the model is loaded. It owns the widgets and hands each
concept to a collaborator built with what it needs: the frame pump (`frame_pump`),
switching (`session_switcher`), the type-ahead (`type_ahead_sender`), each session's
unsent text (`unsent_text`), attachments (`attaching`) and the shown session's commands
(`session_actions`). What stays here is the layout, the key bindings, and one handler per message.

Threads: the service's worker thread buffers reply text and posts every other event
here as a message named for its effect, with the snapshot the event carried
(`service_events`); the UI thread shows it. Sending a message only submits it (the
service sizes and starts the turn on its own threads), so it runs on the UI thread. Its
keys are priority bindings (over the text area's own f6, ctrl+pageup…) that are off
while a dialog or another screen is up; quit is the app's, on every screen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult, SystemCommand
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, TextArea

from kvchat.chat.search import SearchHit
from kvchat.chat.service import SessionService
from kvchat.chat.service_worker import RETRY_SAVE_S
from kvchat.chat.session import SessionSnapshot, SessionView
from kvchat.tui.attaching import Attachments
from kvchat.tui.attachment_chips import AttachmentChips
from kvchat.tui.backend import TuiBackend
from kvchat.tui.command_palette import chat_commands
from kvchat.tui.composer import Composer
from kvchat.tui.frame_pump import FramePump
from kvchat.tui.guarded import guarded, log_failure, notify_bug, notify_failure
from kvchat.tui.keys import CHAT_KEYS, bindings, keys_for
from kvchat.tui.messages import (
    ClearSaveFailure,
    FinishReply,
    RedrawSession,
    RelistSessions,
    ReportSessionFailure,
    ResidencyReady,
    ShowSaveFailure,
    ShowSessionNotice,
    ShowTokensReady,
)
from kvchat.tui.meters import Meters
from kvchat.tui.save_banner import SaveBanner
from kvchat.tui.screens import HelpScreen, TextDialog
from kvchat.tui.service_events import relay_to
from kvchat.tui.session_actions import SessionActions
from kvchat.tui.session_switcher import SessionSwitcher
from kvchat.tui.sidebar import SessionList, SessionRow
from kvchat.tui.stream_buffer import StreamBuffer
from kvchat.tui.titles import NEW_TITLE, title_from
from kvchat.tui.transcript import Transcript
from kvchat.tui.type_ahead_sender import TypeAheadSender
from kvchat.tui.unsent_text import UnsentText


class ChatScreen(Screen[None]):
    """The sessions over one chat service (see the module docstring)."""

    BINDINGS = bindings(CHAT_KEYS, priority=True)  # over the text area's own f6, ctrl+pageup…
    AUTO_FOCUS = "#composer"
    # below 120 columns the meters give their room to the transcript; below 90 the sidebar too
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [
        (0, "-narrow"),
        (90, "-medium"),
        (120, "-wide"),
    ]

    def __init__(
        self,
        service: SessionService,
        backend: TuiBackend,
        keymap: Mapping[str, str],
        *,
        typed_at_start: str = "",
        send_typed: bool = False,
        interrupted: int = 0,
        switch_model: Callable[[], None],
    ) -> None:
        super().__init__()
        self.service = service
        self.backend = backend  # the app owns (and closes) it; a model switch replaces it
        self.keymap = keymap
        self.switch_model = switch_model  # the app's: it owns the backends
        self.serving = False  # True once opened: sessions listed, the composer focused
        self._typed_at_start = typed_at_start  # on the start-up screen: the composer's
        self._send_typed = send_typed  # the start-up screen's send key was pressed
        self._interrupted = interrupted  # replies cut when kvchat last stopped
        self._unsubscribe: Callable[[], None] | None = None
        # kept as attributes: a dialog on top must not hide them from the frame pump
        self.sidebar = SessionList(id="sidebar")
        self.transcript = Transcript(
            retry_key=keys_for("regenerate", keymap).split(",")[0], id="transcript"
        )
        self.composer = Composer(keymap=keymap, id="composer")
        self.attachment_chips = AttachmentChips(id="attachments")
        self.meters = Meters(id="meters")
        self.save_banner = SaveBanner(id="save-banner")
        self.buffer = StreamBuffer()
        transcript_lock = asyncio.Lock()  # a switch's render and a tick's flush never interleave
        self.unsent = UnsentText(service, self.composer)
        self.type_ahead = TypeAheadSender(service, self.composer, self.unsent, workers=self)
        self.sessions = SessionSwitcher(
            service,
            sidebar=self.sidebar,
            transcript=self.transcript,
            composer=self.composer,
            unsent=self.unsent,
            type_ahead=self.type_ahead,
            transcript_lock=transcript_lock,
            backend=lambda: self.backend,
            on_relisted=lambda: self.frames.request_residency(all_sessions=True),
            host=self,
        )
        self.frames = FramePump(
            service,
            buffer=self.buffer,
            sessions=self.sessions,
            type_ahead=self.type_ahead,
            sidebar=self.sidebar,
            transcript=self.transcript,
            meters=self.meters,
            transcript_lock=transcript_lock,
            backend=lambda: self.backend,
            host=self,
        )
        self.attachments = Attachments(
            service,
            composer=self.composer,
            chips=self.attachment_chips,
            current=lambda: self.sessions.current,
            host=self,
        )
        self.actions = SessionActions(
            service,
            sessions=self.sessions,
            composer=self.composer,
            keymap=keymap,
            fork_at=self.fork_at,
            host=self,
        )

    def compose(self) -> ComposeResult:
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

    # ------------------------------------------------------------------ opening

    async def on_mount(self) -> None:
        """List the sessions, open the most recent one with what was typed at start-up."""
        self._unsubscribe = self.service.subscribe(relay_to(self.buffer, self.post_message))
        # Focus first: what a user types while the sessions are listed must reach the composer.
        self.composer.focus()
        self.meters.set_cache_note(self.backend.description)
        for notice in self.backend.notices:
            self.notify(notice, severity="warning", timeout=20)
        views = self.sessions.list_views()
        await self.sidebar.set_sessions(views)
        recent = max(views, key=lambda v: v.updated, default=None)
        typed = self._typed_at_start + self.composer.text  # while starting, then while listing
        self.composer.clear()
        await self.switch_to(recent.id if recent else None)  # its unsent text comes back
        unsent = self.composer.text
        send_typed = self._send_typed
        # never sent with, nor instead of, what was kept from before
        if send_typed and self.composer.message:
            send_typed = False
            self.notify("Not sent yet: the session had unsent text; both are in the box.")
        if typed:  # what was typed while starting goes after the session's unsent text
            self.composer.load_text("\n".join(t for t in (unsent, typed) if t))
        self.composer.move_cursor(self.composer.document.end)
        if self._interrupted:
            n = self._interrupted
            self.notify(
                f"{n} repl{'y was' if n == 1 else 'ies were'} "
                "cut when kvchat last stopped; kept and marked interrupted.",
                severity="warning",
            )
        self.frames.start()
        self.serving = True
        if send_typed:
            self.composer.action_send()  # to the session shown, as if sent just now

    def close(self) -> None:
        """Stop listening; store the composer's text with its session. (A message sent just
        before quitting is stored: the service starts it before it closes.)"""
        self.frames.stop()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            self.unsent.keep(self.sessions.current)

    def backend_switched(self, backend: TuiBackend, name: str) -> None:
        self.backend = backend
        self.meters.set_cache_note(backend.description)
        self.notify(f"Now running {name}: every new turn uses it.")

    # ------------------------------------------------- what the rest of the UI reads

    @property
    def current(self) -> str | None:
        """The session shown."""
        return self.sessions.current

    @property
    def views(self) -> dict[str, SessionView]:
        """The listed sessions' views, by id."""
        return self.sessions.views

    @property
    def show_archived(self) -> bool:
        return self.sessions.show_archived

    async def switch_to(self, session_id: str | None) -> None:
        await self.sessions.switch_to(session_id)

    async def refresh_sessions(self) -> None:
        await self.sessions.refresh_sessions()

    async def open_new_session(self) -> str:
        return await self.sessions.open_new_session()

    @guarded
    def attach_file(self, path: Path) -> None:
        self.attachments.attach_file(path)

    @guarded
    async def fork_at(self, session_id: str, index: int) -> None:
        await self.actions.fork_at(session_id, index)

    @guarded
    async def open_search_hit(self, hit: SearchHit) -> None:
        """The palette's search result: its session, scrolled to the message found."""
        await self.switch_to(hit.session_id)
        if hit.message_id is not None and not self.transcript.show_message(hit.message_id):
            self.notify(
                "Found in an earlier message than the transcript shows; export the session "
                "(ctrl+p, Export to Markdown) to read it."
            )

    def system_commands(self) -> Iterable[SystemCommand]:
        return chat_commands(self)

    # ------------------------------------------------------ what the service said

    def on_show_tokens_ready(self, message: ShowTokensReady) -> None:
        if message.session_id == self.current:
            self.type_ahead.label = message.label

    def on_show_save_failure(self, message: ShowSaveFailure) -> None:
        self.save_banner.show_failure(message.error, message.unsaved_messages, RETRY_SAVE_S)

    def on_clear_save_failure(self, _message: ClearSaveFailure) -> None:
        self.save_banner.clear_failure()
        self.notify("Saving works again: every message is stored.")

    @guarded
    async def on_relist_sessions(self, _message: RelistSessions) -> None:
        await self.refresh_sessions()

    @guarded
    async def on_report_session_failure(self, message: ReportSessionFailure) -> None:
        failure = message.failure
        if not failure.waited:  # refused as it was sent: the message is back to fix
            if failure.text and not self.composer.message:  # nothing typed since
                self.composer.load_message(failure.text)
                self.composer.set_editing(failure.edit)
            if failure.unexpected is not None:
                notify_bug(self, failure.unexpected)
            else:
                self.notify(failure.message, severity="error")
            return
        title = self.sessions.title(failure.session_id)
        self.notify(f"{title}: {failure.message}", severity="error")
        self._redraw_row(failure.snapshot.view)

    @guarded
    async def on_show_session_notice(self, message: ShowSessionNotice) -> None:
        if message.session_id == self.current:
            self.notify(message.text)
        self._redraw_row(message.view)

    @guarded
    async def on_redraw_session(self, message: RedrawSession) -> None:
        if self._redraw_row(message.snapshot.view):
            await self._sync_transcript(message.snapshot, final_flush=False)
            self.sessions.update_title()

    @guarded
    async def on_finish_reply(self, message: FinishReply) -> None:
        snapshot = message.snapshot
        self.meters.turn_finished(snapshot.view.id)  # its figures are this run's
        if not self._redraw_row(snapshot.view):
            return
        await self._sync_transcript(snapshot, final_flush=True)
        self.buffer.finish(message.message_id)
        self.sessions.update_title()
        self.frames.tick_meters()

    def _redraw_row(self, view: SessionView) -> bool:
        """The session's row now if it is the one shown (True), else at the next tick: its
        repaint then shares the tick's screen update instead of costing one of its own."""
        if view.id != self.current:
            self.frames.row_due(view)
            return False
        self.sessions.show_view(view)
        return True

    async def _sync_transcript(self, snapshot: SessionSnapshot, *, final_flush: bool) -> None:
        """The transcript from the event's snapshot (after the last buffered text); a
        snapshot older than the one shown is passed over (the newer one is on screen)."""
        async with self.sessions.transcript_lock:
            if final_flush:
                await self.frames.flush_unlocked()  # the final flush: no token is lost
            await self.sessions.sync_transcript(snapshot)

    def on_residency_ready(self, message: ResidencyReady) -> None:
        self.frames.residency_ready(message.residencies)

    # ------------------------------------------------------------------ the composer

    @guarded
    async def on_composer_submitted(self, message: Composer.Submitted) -> None:
        if self.current is None:
            await self.action_new_session()
        session_id = self.sessions.require_current()
        text = message.text
        editing = self.composer.editing
        view = self.views.get(session_id)
        retitle = not editing and view is not None and view.title == NEW_TITLE
        if editing:
            self.composer.set_editing(False)
        else:
            self.type_ahead.sent()
        self.composer.clear()
        try:  # only submitted: the service sizes and starts the turn on its own threads
            if editing:
                self.service.edit_last_user_message(session_id, text)
            else:  # ends the session's type-ahead, keeping its pages
                title = title_from(text) if retitle else None
                self.service.say(session_id, text, title=title)
        except Exception as exc:  # refused at once: the message is back to fix
            log_failure(exc, "send")
            if not self.composer.message:
                self.composer.load_message(text)
                self.composer.set_editing(editing)
            notify_failure(self, exc)

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area is self.composer:
            self.type_ahead.edited()

    async def on_composer_attachments_changed(self, _message: Composer.AttachmentsChanged) -> None:
        await self.attachments.changed()
        self.type_ahead.edited()  # the message changed: computed ahead anew

    def on_attachment_chips_remove_requested(
        self, message: AttachmentChips.RemoveRequested
    ) -> None:
        self.attachments.remove(message.index)

    def on_session_row_selected(self, message: SessionRow.Selected) -> None:
        self.run_worker(self.switch_to(message.session_id), group="switch")

    # ------------------------------------------------------------------ actions

    @guarded
    async def action_new_session(self) -> None:
        """A session to type into: an empty one already listed (the current one first)
        when there is one, so pressing the key again does not pile up empty "New chat"
        rows; else a new one."""
        empty = self.sessions.empty_session()
        if empty is None:
            await self.open_new_session()
            return
        if empty != self.current:
            await self.switch_to(empty)
        self.composer.focus()

    @guarded
    async def action_previous_session(self) -> None:
        await self._switch_if_other(self.sessions.step(-1))

    @guarded
    async def action_next_session(self) -> None:
        await self._switch_if_other(self.sessions.step(+1))

    @guarded
    async def action_jump(self, n: int) -> None:
        """alt+N: the session numbered N (its number for life, not its row)."""
        await self._switch_if_other(self.sessions.numbered(n))

    async def _switch_if_other(self, target: str | None) -> None:
        if target is not None and target != self.current:
            await self.switch_to(target)

    def action_scroll_transcript(self, pages: int) -> None:
        """pageup / pagedown: a page of the transcript, the composer keeping the focus
        (scrolled to the end, the transcript follows the reply again)."""
        if pages < 0:
            self.transcript.scroll_page_up(animate=False)
        else:
            self.transcript.scroll_page_down(animate=False)

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
        if self.current is not None:
            self.service.stop(self.current)

    @guarded
    def action_regenerate(self) -> None:
        self.service.regenerate(self.sessions.require_current())

    @guarded
    def action_edit_resend(self) -> None:
        self.actions.edit_resend()

    @guarded
    def action_rename(self) -> None:
        self.actions.rename()

    @guarded
    def action_archive(self) -> None:
        self.actions.archive()

    @guarded
    def action_delete(self) -> None:
        self.actions.delete()

    @guarded
    async def action_undo(self) -> None:
        await self.actions.undo()

    @guarded
    def action_copy_reply(self) -> None:
        self.actions.copy_reply()

    @guarded
    def action_export(self) -> None:
        self.actions.export()

    @guarded
    def action_fork(self) -> None:
        self.actions.fork()

    @guarded
    def action_system_prompt(self) -> None:
        self.actions.system_prompt()

    @guarded
    def action_sampling(self) -> None:
        self.actions.sampling()

    @guarded
    def action_attach(self) -> None:
        def done(path_text: str | None) -> None:
            if path_text and path_text.strip():
                self.attach_file(Path(path_text.strip()).expanduser())

        self.app.push_screen(
            TextDialog(
                "Attach a file's text to your message",
                hint="a path (relative to the folder kvchat started in); enter attaches",
            ),
            done,
        )

    async def action_toggle_archived(self) -> None:
        self.sessions.show_archived = not self.sessions.show_archived
        await self.refresh_sessions()
        self.notify("Showing archived sessions." if self.show_archived else "Hiding archived ones.")

    @guarded
    def action_switch_model(self) -> None:
        """f5: the models on this machine; the one chosen serves every later turn."""
        self.switch_model()

    def action_command_palette(self) -> None:
        self.app.action_command_palette()

    def action_theme(self) -> None:
        self.app.action_change_theme()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.keymap))

    def action_toggle_meters(self) -> None:
        """Show or hide the meters. Under 120 columns they are hidden to begin with, and
        shown they take the sidebar's place (the transcript keeps its width)."""
        self.toggle_class("-meters-toggled")

    async def action_quit(self) -> None:
        await self.app.action_quit()
