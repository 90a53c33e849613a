"""The headless script: JSON Lines, one operation a line, validated whole before anything runs.

A mistake at line 40 of a script must not surface after 39 lines of replies
have taken minutes, so `parse_script` checks every line (JSON, op, keys and
their types, sessions created before use, files readable) and raises a
`ScriptError` carrying the line number. Files named by `say` are read here,
relative to the script's folder, so a missing file is also caught up front
(`draft` reads them the same way).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError


class ScriptError(KvchatError):
    """A bad script line; `line` is 1-based (None: the script as a whole)."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.message = message
        self.line = line


@dataclass(frozen=True)
class NewOp:
    line: int
    session: str
    system: str | None = None
    title: str | None = None


@dataclass(frozen=True)
class SayOp:
    line: int
    session: str
    text: str  # the file's text first (when given), then the text
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class TypeAheadOp:
    """The user text a `say` with the same keys would send, computed ahead (type-ahead)."""

    line: int
    session: str
    text: str


@dataclass(frozen=True)
class PauseOp:
    """Sleep the script only: type-aheads and replies keep running."""

    line: int
    seconds: float


@dataclass(frozen=True)
class WaitOp:
    line: int
    session: str | None = None  # None: every session


@dataclass(frozen=True)
class StopOp:
    line: int
    session: str


@dataclass(frozen=True)
class SwitchOp:
    line: int
    session: str


@dataclass(frozen=True)
class StatsOp:
    line: int


Op = NewOp | SayOp | TypeAheadOp | PauseOp | WaitOp | StopOp | SwitchOp | StatsOp


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# key -> (check, what it must be)
_CHECKS: dict[str, tuple[Any, str]] = {
    "session": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "system": (lambda v: isinstance(v, str), "a string"),
    "title": (lambda v: isinstance(v, str), "a string"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "file": (lambda v: isinstance(v, str) and v != "", "a file path string"),
    "max_tokens": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number at least 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer at least 0"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "seed": (_is_int, "an integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "seconds": (lambda v: _is_number(v) and 0 <= v < float("inf"), "a number at least 0"),
}

_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos")

# op -> (required keys, optional keys)
_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "new": (("session",), ("system", "title")),
    "say": (("session",), ("text", "file", *_SAMPLING_KEYS)),
    "draft": (("session",), ("text", "file")),
    "pause": (("seconds",), ()),
    "wait": ((), ("session",)),
    "stop": (("session",), ()),
    "switch": (("session",), ()),
    "stats": ((), ()),
}


# What each op does, for `kvchat run --help` (the keys are listed from `_OPS`).
_OP_HELP: dict[str, str] = {
    "new": "create a session named by 'session' (optionally its system prompt and title)",
    "say": "send a message: 'text', or a file's text ('file': absolute, or relative to "
    "the script's folder) then 'text'; it must not be empty; does not wait for the reply",
    "draft": "compute the session's next message ahead while it is typed (its text built as "
    "'say' builds it; a later draft replaces it, a 'say' ends it); prints no reply",
    "pause": "sleep the script for 'seconds' (drafts and replies keep running)",
    "wait": "wait until the session's reply (every session's, without 'session') has ended",
    "stop": "stop the session's reply",
    "switch": "make the session the focused one (its pages are prefetched)",
    "stats": "print a stats event (the engine's counters)",
}


def script_format_help() -> str:
    """The script format as `kvchat run --help` prints it: every op, its keys and their types."""
    lines = [
        'script format: JSON Lines, one object a line with an "op"; blank lines are skipped.',
        "The whole script is checked before the model loads (a bad line exits 2 with its number).",
        "",
    ]
    for op, (required, optional) in _OPS.items():
        keys = [f"{k} (required)" for k in required] + list(optional)
        lines += textwrap.wrap(
            _OP_HELP[op], width=88, initial_indent=f"  {op:<7}", subsequent_indent=" " * 9
        )
        if keys:
            lines += textwrap.wrap(
                ", ".join(keys),
                width=88,
                initial_indent="         keys: ",
                subsequent_indent=" " * 15,
            )
    lines += ["", "key types:"]
    lines += [f"  {key:<12}{what}" for key, (_check, what) in _CHECKS.items()]
    lines += [
        "",
        "example:",
        '  {"op": "new", "session": "a", "system": "Answer briefly."}',
        '  {"op": "say", "session": "a", "file": "notes.md", "text": "Summarize this."}',
        '  {"op": "say", "session": "a", "text": "And in one word?", "temperature": 0}',
        '  {"op": "wait"}',
        '  {"op": "stats"}',
        "",
        "output: one JSON object a line on stdout: reply events (token events too with",
        "--stream), stats events, and error events {event, message, line}. A script that",
        "cannot be read or parsed runs nothing: one error event on stderr, exit code 2.",
    ]
    return "\n".join(lines)


def parse_script(text: str, base_dir: Path) -> list[Op]:
    """Every operation of the script, or a ScriptError for the first bad line (or an empty
    script: running nothing would load the model for nothing)."""
    ops: list[Op] = []
    sessions: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"not valid JSON ({exc.msg} at column {exc.colno})", number) from None
        if not isinstance(obj, dict):
            raise ScriptError('each line must be a JSON object with an "op"', number)
        op = obj.get("op")
        if not isinstance(op, str) or op not in _OPS:  # a list or an object is unhashable
            raise ScriptError(
                f"unknown op {op if isinstance(op, str) else json.dumps(op)!r}; "
                f"the ops are {', '.join(_OPS)}"
                if op is not None
                else 'missing "op"',
                number,
            )
        required, optional = _OPS[op]
        for key in obj:
            if key != "op" and key not in required and key not in optional:
                raise ScriptError(f"unknown key {key!r} for op {op!r}", number)
        for key in required:
            if key not in obj:
                raise ScriptError(f"op {op!r} needs {key!r}", number)
        for key, value in obj.items():
            if key == "op":
                continue
            check, what = _CHECKS[key]
            if not check(value):
                raise ScriptError(f"{key!r} must be {what}, not {json.dumps(value)}", number)
        session = obj.get("session")
        if op == "new":
            if session in sessions:
                raise ScriptError(f"session {session!r} already exists", number)
            sessions.add(session)
        elif session is not None and session not in sessions:
            raise ScriptError(
                f"unknown session {session!r}; create it first with "
                f'{{"op": "new", "session": "{session}"}}',
                number,
            )
        ops.append(_build(op, obj, number, base_dir))
    if not ops:
        raise ScriptError(
            'the script is empty: write one JSON object a line, like {"op": "new", '
            '"session": "a"} (see kvchat run --help)',
            None,
        )
    return ops


def _build(op: str, obj: dict[str, Any], number: int, base_dir: Path) -> Op:
    if op == "new":
        return NewOp(number, obj["session"], obj.get("system"), obj.get("title"))
    if op in ("say", "draft"):
        text = _user_text(op, obj, number, base_dir)
        if op == "draft":  # an empty text ends the session's type-ahead
            return TypeAheadOp(number, obj["session"], text)
        if not text.strip():
            raise ScriptError(
                "the message is empty (its file and text hold only whitespace); "
                "give the text to send",
                number,
            )
        sampling = {k: obj[k] for k in _SAMPLING_KEYS if k in obj}
        return SayOp(number, obj["session"], text, **sampling)
    if op == "pause":
        return PauseOp(number, float(obj["seconds"]))
    if op == "wait":
        return WaitOp(number, obj.get("session"))
    if op == "stop":
        return StopOp(number, obj["session"])
    if op == "switch":
        return SwitchOp(number, obj["session"])
    return StatsOp(number)


def _user_text(op: str, obj: dict[str, Any], number: int, base_dir: Path) -> str:
    """The file's text (relative to the script's folder), a blank line, then `text`."""
    if "text" not in obj and "file" not in obj:
        raise ScriptError(f'op "{op}" needs "text" or "file"', number)
    parts = []
    if "file" in obj:
        path = Path(obj["file"]).expanduser()
        path = path if path.is_absolute() else base_dir / path
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ScriptError(f"cannot read file {str(path)!r}: {reason}", number) from None
    if "text" in obj:
        parts.append(obj["text"])
    return "\n\n".join(parts)
