"""The command palette's commands (ctrl+backslash): every action of the chat screen by name.

The app's `get_system_commands` gives these in place of Textual's own once the chat
screen is up, and only Quit before.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from textual.app import SystemCommand

if TYPE_CHECKING:
    from kvchat.tui.chat_screen import ChatScreen


def chat_commands(chat: ChatScreen) -> Iterator[SystemCommand]:
    """The chat screen's actions by name, in the palette's order."""
    commands = [
        ("New session", "start a conversation", chat.action_new_session),
        ("Stop", "stop the reply being written", chat.action_stop),
        ("Regenerate", "write the last reply again", chat.action_regenerate),
        (
            "Edit and resend",
            "edit your last message and send it again",
            chat.action_edit_resend,
        ),
        ("Rename", "rename this session", chat.action_rename),
        ("Archive", "hide this session (undo brings it back)", chat.action_archive),
        ("Delete", "delete this session (undo until the next start)", chat.action_delete),
        ("Undo", "bring back the last archived or deleted session", chat.action_undo),
        ("Copy last reply", "copy it to the clipboard", chat.action_copy_reply),
        ("Attach file", "add a file's text to your message", chat.action_attach),
        ("Export to Markdown", "write this session to a .md file", chat.action_export),
        ("Fork at message", "a new session from a point of this one", chat.action_fork),
        ("System prompt", "this session's system prompt", chat.action_system_prompt),
        ("Sampling parameters", "temperature, top-p… for this session", chat.action_sampling),
        (
            "Hide archived sessions" if chat.show_archived else "Show archived sessions",
            "list archived sessions in the sidebar",
            chat.action_toggle_archived,
        ),
        ("Theme", "change the colors (remembered)", chat.action_theme),
        ("Switch model", "run another model on this machine (f5)", chat.action_switch_model),
        ("Help", "keys and where kvchat keeps its files", chat.action_help),
        ("Quit", "quit kvchat", chat.action_quit),
    ]
    for title, help_text, callback in commands:
        yield SystemCommand(title, help_text, callback)
