"""What the keys and the palette do to the shown session: rename, archive, fork, export…

Each method raises `KvchatError` for a user's mistake ("there is no reply to copy
yet"); the chat screen's action that calls it shows that as a notification. Those that
ask for text open a `TextDialog` and act when it is answered.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from textual.command import SimpleCommand
from textual.widget import Widget

from kvchat.chat.sampling_text import parse_sampling, sampling_text
from kvchat.chat.service import SessionService
from kvchat.chat.session import MessageView, TurnState
from kvchat.errors import KvchatError
from kvchat.tui.composer import Composer
from kvchat.tui.keys import keys_for
from kvchat.tui.screens import TextDialog
from kvchat.tui.session_switcher import SessionSwitcher


class SessionActions:
    """The shown session's commands (see the module docstring)."""

    def __init__(
        self,
        service: SessionService,
        *,
        sessions: SessionSwitcher,
        composer: Composer,
        keymap: Mapping[str, str],
        fork_at: Callable[[str, int], Awaitable[None]],
        host: Widget,
    ) -> None:
        self.service = service
        self.sessions = sessions
        self.composer = composer
        self.keymap = keymap
        self.fork_at_command = fork_at  # what a fork command runs (shows its own failures)
        self.host = host  # shows the dialogs and the notices
        self.undo_stack: list[tuple[str, str]] = []  # (archive|delete, session id)

    def edit_resend(self) -> None:
        session_id = self.sessions.require_current()
        users = [m for m in self.service.messages(session_id) if m.role == "user"]
        if not users:
            raise KvchatError("there is no message of yours to edit")
        self.composer.load_message(users[-1].content)
        self.composer.set_editing(True)
        self.composer.focus()

    def rename(self) -> None:
        session_id = self.sessions.require_current()
        view = self.sessions.views[session_id]

        def done(title: str | None) -> None:
            if title and title.strip():
                self.service.rename(session_id, title.strip())
                self.sessions.update_title()

        self.host.app.push_screen(TextDialog("Rename the session", view.title), done)

    def archive(self) -> None:
        session_id = self.sessions.require_current()
        archived = self.sessions.views[session_id].archived
        self.service.set_archived(session_id, not archived)
        if not archived:
            self.undo_stack.append(("archive", session_id))
            self.host.notify(
                f"Archived “{self.sessions.title(session_id)}”. "
                f"{keys_for('undo', self.keymap)} brings it back."
            )

    def delete(self) -> None:
        session_id = self.sessions.require_current()
        self.service.delete(session_id)
        self.undo_stack.append(("delete", session_id))
        self.host.notify(
            f"Deleted “{self.sessions.title(session_id)}”. {keys_for('undo', self.keymap)} "
            "brings it back (until kvchat restarts)."
        )

    async def undo(self) -> None:
        if not self.undo_stack:
            raise KvchatError("nothing to undo")
        kind, session_id = self.undo_stack.pop()
        if kind == "archive":
            self.service.set_archived(session_id, False)
        else:
            self.service.undo_delete(session_id)
        await self.sessions.refresh_sessions()
        await self.sessions.switch_to(session_id)

    def copy_reply(self) -> None:
        session_id = self.sessions.require_current()
        replies = [m for m in self.service.messages(session_id) if m.role == "assistant"]
        if not replies or not replies[-1].content:
            raise KvchatError("there is no reply to copy yet")
        self.host.app.copy_to_clipboard(replies[-1].content)
        self.host.notify("Copied the last reply to the clipboard.")

    def export(self) -> None:
        session_id = self.sessions.require_current()
        default = f"{_slug(self.sessions.title(session_id))}.md"

        def done(path_text: str | None) -> None:
            if not path_text:
                return
            path = Path(path_text.strip()).expanduser()
            try:
                path.write_text(self.service.export_markdown(session_id), encoding="utf-8")
            except OSError as exc:
                self.host.notify(f"Cannot write {path}: {exc.strerror or exc}", severity="error")
                return
            self.host.notify(f"Exported to {path.resolve()}")

        self.host.app.push_screen(TextDialog("Export the session as Markdown to", default), done)

    def fork(self) -> None:
        """The palette lists where the session can be forked: before each message of
        yours, and at the end when no reply is on the way."""
        session_id = self.sessions.require_current()
        messages = self.service.messages(session_id)
        commands: list[SimpleCommand] = [
            SimpleCommand(
                f"Fork before message {m.index + 1}: {_preview(m)}",
                functools.partial(self.fork_at_command, session_id, m.index),
                "a new session with the messages before this one (shares their cache)",
            )
            for m in reversed(messages)
            if m.role == "user"
        ]
        if self.sessions.views[session_id].state == TurnState.IDLE:
            commands.insert(
                0,
                SimpleCommand(
                    "Fork at the end",
                    functools.partial(self.fork_at_command, session_id, len(messages)),
                    "a copy of the whole session",
                ),
            )
        if not commands:
            raise KvchatError("nothing to fork yet")
        self.host.app.search_commands(commands, placeholder="Fork the session at…")

    async def fork_at(self, session_id: str, index: int) -> None:
        new_id = self.service.fork(session_id, index)
        self.sessions.views[new_id] = self.service.session(new_id)
        await self.sessions.refresh_sessions()
        await self.sessions.switch_to(new_id)

    def system_prompt(self) -> None:
        session_id = self.sessions.require_current()
        view = self.sessions.views[session_id]

        def done(text: str | None) -> None:
            if text is not None:
                try:
                    self.service.set_system_prompt(session_id, text.strip() or None)
                except KvchatError as exc:
                    self.host.notify(str(exc), severity="error")

        self.host.app.push_screen(
            TextDialog(
                "System prompt (empty removes it)", view.system_prompt or "", multiline=True
            ),
            done,
        )

    def sampling(self) -> None:
        session_id = self.sessions.require_current()
        view = self.sessions.views[session_id]

        def done(text: str | None) -> None:
            if not text:
                return
            try:
                sampling, max_tokens = parse_sampling(text, view.sampling, view.max_tokens)
            except KvchatError as exc:
                self.host.notify(str(exc), severity="error")
                return
            self.service.set_sampling(session_id, sampling, max_tokens)
            self.host.notify("Sampling parameters set for this session's next turns.")

        self.host.app.push_screen(
            TextDialog("Sampling for this session", sampling_text(view.sampling, view.max_tokens)),
            done,
        )


def _preview(message: MessageView) -> str:
    text = " ".join(message.content.split())
    return text if len(text) <= 50 else text[:49] + "…"


def _slug(title: str) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug or "session"
