"""The command palette's commands (ctrl+backslash): every action of the app by name.

`CommandPalette` is mixed into `KvchatApp`, ahead of Textual's `App`, whose system
commands it replaces.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual.app import SystemCommand
from textual.screen import Screen


class CommandPalette:
    """`get_system_commands` for `KvchatApp`: its actions by name, or only Quit before start."""

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        if self.service is None:
            yield SystemCommand("Quit", "quit kvchat", self.action_quit)
            return
        commands = [
            ("New session", "start a conversation", self.action_new_session),
            ("Stop", "stop the reply being written", self.action_stop),
            ("Regenerate", "write the last reply again", self.action_regenerate),
            (
                "Edit and resend",
                "edit your last message and send it again",
                self.action_edit_resend,
            ),
            ("Rename", "rename this session", self.action_rename),
            ("Archive", "hide this session (undo brings it back)", self.action_archive),
            ("Delete", "delete this session (undo until the next start)", self.action_delete),
            ("Undo", "bring back the last archived or deleted session", self.action_undo),
            ("Copy last reply", "copy it to the clipboard", self.action_copy_reply),
            ("Attach file", "add a file's text to your message", self.action_attach),
            ("Export to Markdown", "write this session to a .md file", self.action_export),
            ("Fork at message", "a new session from a point of this one", self.action_fork),
            ("System prompt", "this session's system prompt", self.action_system_prompt),
            ("Sampling parameters", "temperature, top-p… for this session", self.action_sampling),
            (
                "Hide archived sessions" if self.show_archived else "Show archived sessions",
                "list archived sessions in the sidebar",
                self.action_toggle_archived,
            ),
            ("Theme", "change the colors (remembered)", self.action_theme),
            ("Switch model", "run another model on this machine (f5)", self.action_switch_model),
            ("Help", "keys and where kvchat keeps its files", self.action_help),
            ("Quit", "quit kvchat", self.action_quit),
        ]
        for title, help_text, callback in commands:
            yield SystemCommand(title, help_text, callback)
