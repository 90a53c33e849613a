"""Every key of the TUI: one table of binding ids, default keys and descriptions.

Why one table: the settings file's `[keys]` section remaps bindings by id
(`next_session = "ctrl+right"`), the help screen lists them, and the footer shows
them; all three read this table, so an id means one thing everywhere. Defaults
avoid the keys the input box uses for editing (ctrl+a/e/w/d/k/u/x/c/v/z/y), and
session switching has two pairs because many terminals keep one pair for tabs.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass

from textual import _ansi_sequences
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
    KeySpec("regenerate", "ctrl+r", "regenerate", "Retry", show=True),  # writes the reply again
    KeySpec("edit_resend", "f3", "edit_resend", "Edit last"),
    KeySpec("rename", "f2", "rename", "Rename"),
    KeySpec("archive", "f6", "archive", "Archive"),
    KeySpec("delete", "f8", "delete", "Delete"),
    KeySpec("undo", "f9", "undo", "Undo"),
    KeySpec("copy_reply", "f4", "copy_reply", "Copy reply"),
    KeySpec("attach", "ctrl+o", "attach", "Attach", show=True),
    KeySpec("toggle_meters", "f7", "toggle_meters", "Meters", show=True),
    KeySpec("switch_model", "f5", "switch_model", "Model"),
    # the transcript scrolls from wherever the focus is (the composer, mostly)
    KeySpec("scroll_up", "pageup", "scroll_transcript(-1)", "Scroll up"),
    KeySpec("scroll_down", "pagedown", "scroll_transcript(1)", "Scroll down"),
    KeySpec("scroll_top", "ctrl+home", "scroll_transcript_to(0)", "Transcript top"),
    KeySpec("scroll_bottom", "ctrl+end", "scroll_transcript_to(1)", "Transcript end"),
    KeySpec("command_palette", "ctrl+p", "command_palette", "Palette", show=True),
    KeySpec("help", "f1", "help", "Help", show=True),
    KeySpec("quit", "ctrl+q", "quit", "Quit", show=True),
)

# The app's own: quit works on every screen (a dialog's too), and Textual adds a palette
# key of its own to an app that binds none. The chat screen binds every key, quit first:
# the footer lists a screen's keys in its order, and quit follows the composer's there.
GLOBAL_KEYS: tuple[KeySpec, ...] = tuple(s for s in APP_KEYS if s.id in ("quit", "command_palette"))
CHAT_KEYS: tuple[KeySpec, ...] = (
    *(s for s in APP_KEYS if s.id == "quit"),
    *(s for s in APP_KEYS if s.id != "quit"),
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


def check_keymap(
    keys: Mapping[str, str], sources: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """The settings' `[keys]` split into a usable keymap and one problem line per bad entry.

    A remap onto a key another binding has (`quit = "ctrl+n"`) is refused and reported:
    taken silently, it would remove that other action from the keyboard.
    """
    keymap, problems = _known_entries(keys)
    specs = {s.id: s for s in ALL_KEYS}
    # keys held by the bindings the user leaves alone, then by each accepted remap in turn
    taken: dict[str, str] = {}
    for spec in ALL_KEYS:
        if spec.id not in keymap:
            for key in _split(spec.keys):
                taken.setdefault(key, spec.id)
    for binding_id, key_list in list(keymap.items()):
        clashes = [
            (k, taken[k]) for k in _split(key_list) if taken.get(k, binding_id) != binding_id
        ]
        if clashes:
            key, other = clashes[0]
            del keymap[binding_id]
            problems.append(
                f'[keys] {binding_id} = "{key_list}": {key} is already the key of {other} '
                f"({specs[other].description}); {binding_id} keeps "
                f"{specs[binding_id].keys}. Choose a free key, or move {other} too."
            )
            key_list = specs[binding_id].keys
        for key in _split(key_list):
            taken.setdefault(key, binding_id)
    return keymap, [_placed(problem, sources or {}) for problem in problems]


def _placed(problem: str, sources: Mapping[str, str]) -> str:
    """The problem with the file and line of the binding it names in front, when known."""
    binding = problem.removeprefix("[keys] ").split(" ", 1)[0].rstrip(":")
    where = sources.get(f"keys.{binding}")
    return f"{where}: {problem}" if where else problem


def _split(keys: str) -> list[str]:
    return [part.strip() for part in keys.split(",") if part.strip()]


MODIFIERS = frozenset({"ctrl", "shift", "alt", "meta", "super", "hyper"})


@functools.cache
def _key_names() -> frozenset[str]:
    """Every key name a terminal's key can arrive as in Textual: its named keys
    (`right`, `pageup`, `f5`), their aliases, and the names of the printable characters
    (`minus`, `full_stop`)."""
    from textual.keys import KEY_ALIASES, Keys, _character_to_key

    names = {key.value.rsplit("+", 1)[-1] for key in Keys} | set(KEY_ALIASES)
    names |= {_character_to_key(chr(code)) for code in range(32, 127)}
    return frozenset(names)


def key_name_problem(name: str) -> str | None:
    """Why `name` ("ctrl+rigth") is no key a terminal can send, or None when it is one:
    a misspelled name taken silently would leave its action on no key at all."""
    from textual.keys import key_to_character

    *modifiers, base = name.split("+") if name != "+" else ["+"]
    unknown = [m for m in modifiers if m not in MODIFIERS]
    if unknown:
        return f"{unknown[0]!r} is not a modifier (ctrl, shift, alt, meta, super)"
    if len(base) == 1 or base in _key_names() or key_to_character(base) is not None:
        return None
    return f"{base!r} is no key name (like right, pageup, f5, enter, a)"


def _known_entries(keys: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Entries naming a known binding and keys a terminal can send; a problem line for
    the others (the binding then keeps its default keys)."""
    keymap: dict[str, str] = {}
    problems: list[str] = []
    for binding_id, key in keys.items():
        if binding_id not in BINDING_IDS:
            problems.append(
                f"[keys] {binding_id}: no such key binding "
                f"(known: {', '.join(sorted(BINDING_IDS))})."
            )
            continue
        parts = [part.strip() for part in key.split(",") if part.strip()]
        if not parts:
            problems.append(f'[keys] {binding_id}: needs a key name, like "ctrl+n".')
            continue
        bad = next(((p, why) for p in parts if (why := key_name_problem(p))), None)
        if bad is not None:
            default = next(s.keys for s in ALL_KEYS if s.id == binding_id)
            problems.append(
                f'[keys] {binding_id} = "{key}": {bad[1]}; {binding_id} keeps {default}.'
            )
            continue
        keymap[binding_id] = ",".join(parts)
    return keymap, problems


def keys_for(binding_id: str, keymap: Mapping[str, str]) -> str:
    """The keys a binding has now (the user's or the default), for help and messages."""
    if binding_id in keymap:
        return keymap[binding_id]
    return next(s.keys for s in ALL_KEYS if s.id == binding_id)


# alt+0..alt+9 as the key names Textual binds; a str enum like Textual's own `Keys`
MetaDigit = enum.Enum("MetaDigit", {f"ALT_{d}": f"alt+{d}" for d in "0123456789"}, type=str)


def install_meta_digit_keys() -> None:
    """Read ESC followed by a digit as alt+digit.

    Why: tmux, screen, xterm with metaSendsEscape and kitty's legacy mode send alt+2
    as ESC 2 (the "meta sends escape" form). Textual maps exactly these sequences to the
    characters macOS types for Option+digit ("¡", "™", ...), for WezTerm on macOS, so in
    tmux alt+1..9 typed "¡™" into the composer instead of switching sessions. kvchat binds
    alt+digit, so the escape form becomes that key. A character typed as such (a Spanish
    keyboard's "¡") is not an escape sequence and still types itself.
    """
    for digit in "0123456789":
        _ansi_sequences.ANSI_SEQUENCES_KEYS[f"\x1b{digit}"] = (MetaDigit[f"ALT_{digit}"],)
