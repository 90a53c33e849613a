"""Every key of the TUI: one table of binding ids, default keys and descriptions.

Why one table: the settings file's `[keys]` section remaps bindings by id
(`next_session = "ctrl+right"`), the help screen lists them, and the footer shows
them; all three read this table, so an id means one thing everywhere. Defaults
avoid the keys the input box uses for editing (ctrl+a/e/w/d/k/u/x/c/v/z/y), and
session switching has two pairs because many terminals keep one pair for tabs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class KeySpec:
    id: str
    keys: str  # Textual key names, comma-separated
    action: str
    description: str
    show: bool = False  # shown in the footer


APP_KEYS: tuple[KeySpec, ...] = (
    KeySpec("new_session", "ctrl+n", "new_session", "New", show=True),
    KeySpec("previous_session", "ctrl+pageup,alt+up", "previous_session", "Prev", show=True),
    KeySpec("next_session", "ctrl+pagedown,alt+down", "next_session", "Next", show=True),
    *(KeySpec(f"jump_{n}", f"alt+{n}", f"jump({n})", f"Session {n}") for n in range(1, 10)),
    KeySpec("stop", "escape", "stop", "Stop", show=True),
    KeySpec("regenerate", "ctrl+r", "regenerate", "Regenerate", show=True),
    KeySpec("edit_resend", "f3", "edit_resend", "Edit last"),
    KeySpec("rename", "f2", "rename", "Rename"),
    KeySpec("archive", "f6", "archive", "Archive"),
    KeySpec("delete", "f8", "delete", "Delete"),
    KeySpec("undo", "f9", "undo", "Undo"),
    KeySpec("copy_reply", "f4", "copy_reply", "Copy reply"),
    KeySpec("attach", "ctrl+o", "attach", "Attach file", show=True),
    KeySpec("command_palette", "ctrl+p", "command_palette", "Commands", show=True),
    KeySpec("help", "f1", "help", "Help", show=True),
    KeySpec("quit", "ctrl+q", "quit", "Quit", show=True),
)

COMPOSER_KEYS: tuple[KeySpec, ...] = (
    KeySpec("send", "enter", "send", "Send", show=True),
    KeySpec("newline", "shift+enter,ctrl+j", "newline", "Newline"),
)

ALL_KEYS: tuple[KeySpec, ...] = APP_KEYS + COMPOSER_KEYS
BINDING_IDS: frozenset[str] = frozenset(k.id for k in ALL_KEYS)


def bindings(specs: tuple[KeySpec, ...], *, priority: bool = False) -> list[Binding]:
    return [
        Binding(s.keys, s.action, s.description, show=s.show, id=s.id, priority=priority)
        for s in specs
    ]


def check_keymap(keys: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The settings' `[keys]` split into a usable keymap and one problem line per bad entry."""
    keymap: dict[str, str] = {}
    problems: list[str] = []
    for binding_id, key in keys.items():
        if binding_id not in BINDING_IDS:
            problems.append(
                f"[keys] {binding_id}: no such key binding "
                f"(known: {', '.join(sorted(BINDING_IDS))})"
            )
            continue
        cleaned = ",".join(part.strip() for part in key.split(",") if part.strip())
        if not cleaned:
            problems.append(f'[keys] {binding_id}: needs a key name, like "ctrl+n"')
            continue
        keymap[binding_id] = cleaned
    return keymap, problems


def keys_for(binding_id: str, keymap: Mapping[str, str]) -> str:
    """The keys a binding has now (the user's or the default), for help and messages."""
    if binding_id in keymap:
        return keymap[binding_id]
    return next(s.keys for s in ALL_KEYS if s.id == binding_id)
