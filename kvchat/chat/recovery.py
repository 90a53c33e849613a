"""The recovery file: what could not be stored in the database, written when kvchat stops.

Nothing a user typed or received is lost when the database refuses writes: the
messages still waiting are written as JSON (one object: the sessions, each with
its title and its unsaved messages in order) to the data folder, or to the system's temporary
folder when that fails too. Written to a temporary name then renamed, readable by
the user only.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.chat.write_behind import PendingSession


@dataclass(frozen=True)
class UnsavedReport:
    """What a stopping service could not store: how much, and where it went instead."""

    messages: int
    sessions: int
    path: Path | None  # None: no folder took the file; `text` is all there is
    text: str
    error: str | None  # the store's last failure

    def summary(self) -> str:
        """One line for the user: how much was not saved, why, and where it is."""
        if self.messages:
            what = f"{self.messages} message{'' if self.messages == 1 else 's'}"
        else:
            what = f"changes to {self.sessions} session{'' if self.sessions == 1 else 's'}"
        why = f" ({self.error})" if self.error else ""
        if self.path is not None:
            return f"{what} could not be saved in the session database{why}: see {self.path}"
        return (
            f"{what} could not be saved in the session database{why}, nor written to a "
            "recovery file; they follow as JSON"
        )


def recovery_json(pending: Sequence[PendingSession], database: str, error: str | None) -> str:
    sessions = [
        {
            "id": p.session.id,
            "title": p.session.title,
            "messages": [
                {
                    "id": m.id,
                    "role": m.role,
                    "content": m.content,
                    "state": m.state,
                    "created": m.created,
                }
                for m in p.messages.values()
            ],
        }
        for p in pending
    ]
    document = {
        "kvchat_unsaved_messages": 1,
        "database": database,
        "error": error,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "sessions": sessions,
    }
    return json.dumps(document, ensure_ascii=False, indent=2) + "\n"


def write_recovery(
    pending: Sequence[PendingSession],
    database: str,
    error: str | None,
    folders: Sequence[Path],
) -> UnsavedReport | None:
    """Write what is pending to the first folder that takes it; None when nothing is."""
    if not pending:
        return None
    count = sum(len(p.messages) for p in pending)
    text = recovery_json(pending, database, error)
    name = f"unsaved-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    for folder in [*folders, Path(tempfile.gettempdir())]:
        path = folder / name
        partial = path.with_suffix(".partial")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            partial.replace(path)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink()
            continue
        return UnsavedReport(count, len(pending), path, text, error)
    return UnsavedReport(count, len(pending), None, text, error)
