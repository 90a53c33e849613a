"""Why the session database cannot be opened, in words a user can act on.

Why a diagnosis and not SQLite's message: "attempt to write a readonly database" or
"unable to open database file" does not say which path is at fault, and the advice
for a corrupt file (move it away) is wrong for a permission problem: moving the file
would hide the user's sessions. SQLite in WAL mode writes two files beside the
database (`-wal`, `-shm`), so the folder must be writable as well as the file.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path


def _mode(path: Path) -> str:
    try:
        return stat.filemode(path.stat().st_mode)
    except OSError:
        return "unknown permissions"


def _writable(path: Path) -> bool:
    """Whether this process may write `path` (by its permission bits when running as root,
    which `os.access` would always allow)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if not os.access(path, os.W_OK):
        return False
    running_as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return bool(mode & 0o222) if running_as_root else True


def _first_missing_parent(path: Path) -> Path:
    """The deepest existing folder above `path` (where a folder would have to be created)."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def access_problem(path: Path) -> str | None:
    """What keeps this process from writing the database at `path`, or None when nothing
    about permissions does."""
    folder = path.parent
    if not folder.exists():
        existing = _first_missing_parent(path)
        if not _writable(existing):
            return (
                f"the folder {existing} is not writable ({_mode(existing)}), so kvchat cannot "
                f"create {folder} for its session database. Make it writable "
                f"(chmod u+w {existing}) or point KVCHAT_HOME at a folder you own."
            )
        return None
    if not folder.is_dir():
        return f"{folder} is not a folder, so the session database cannot be kept there."
    if path.exists() and not _writable(path):
        return (
            f"the session database {path} is read-only ({_mode(path)}). Make it writable "
            f"(chmod u+w {path}), or run kvchat as the user who owns it."
        )
    for suffix in ("-wal", "-shm"):
        companion = path.with_name(path.name + suffix)
        if companion.exists() and not _writable(companion):
            return (
                f"the database's journal file {companion} is read-only ({_mode(companion)}). "
                f"Make it writable (chmod u+w {companion})."
            )
    if not _writable(folder):
        return (
            f"the folder {folder} is not writable ({_mode(folder)}); SQLite keeps its journal "
            f"files beside the database there. Make it writable (chmod u+w {folder})."
        )
    return None


def open_failure_message(path: Path, exc: BaseException) -> str:
    """One message for a database that failed to open: permissions first (they are the
    likely cause of an OperationalError), then corruption, then SQLite's own words."""
    problem = access_problem(path)
    if problem is not None:
        return f"cannot open the session database: {problem}"
    if isinstance(exc, PermissionError):
        return (
            f"cannot open the session database {path}: permission denied ({exc.filename}). "
            "Make that path writable or point KVCHAT_HOME at a folder you own."
        )
    reason = str(exc)
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return (
            f"cannot open the session database {path}: {reason}. The file is damaged or not "
            "a kvchat database. Move the file away to start with an empty one."
        )
    return f"cannot open the session database {path}: {reason}."
