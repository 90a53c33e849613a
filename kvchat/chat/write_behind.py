"""`WriteBehind`: the session writes waiting for the store, coalesced per session, retried.

Why it exists: the service snapshots a session under its lock and writes the
snapshot later on its worker thread, so neither the engine nor the UI waits on
the disk. A write can fail (a disk I/O error, a read-only or full database) and
then nothing may be dropped: the snapshot stays pending, a later snapshot of the
same message replaces it (new messages keep their order), every later write and
a timer retry it, and whatever is still pending when kvchat stops is written to
a recovery file (`recovery.py`). Failures are reported once per streak, with the
number of messages waiting, so a UI can show them until saving works again.

It also remembers each session's revision in the store: when another process
wrote a session since this one last did, the session has `diverged` (this
process's token ids do not render the other's turns) and every later save of it
stores the ids as stale, so the next start renders it from all its messages.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvchat.chat.store import MessageRecord, SessionRecord, Store


@dataclass
class PendingSession:
    """The latest snapshot of a session not yet stored, and the messages to store or delete."""

    session: SessionRecord
    messages: dict[str, MessageRecord] = field(default_factory=dict)  # in the order to append
    removed: list[str] = field(default_factory=list)

    def merge(self, newer: PendingSession) -> None:
        """Fold a later snapshot of the same session into this one."""
        self.session = newer.session
        for message_id in newer.removed:
            self.messages.pop(message_id, None)
        self.removed += newer.removed
        self.messages.update(newer.messages)  # a known id keeps its place, new ones append


@dataclass(frozen=True)
class DrainResult:
    error: str | None  # the failure that stopped this drain (None: everything pending is stored)
    unsaved_messages: int  # messages still waiting after it
    diverged: tuple[str, ...]  # sessions found written by another process for the first time


class WriteBehind:
    """Pending writes of sessions; `add` from any thread, `drain` on one worker thread."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._pending: dict[str, PendingSession] = {}
        self._in_flight: dict[str, PendingSession] = {}  # taken by the drain running now
        self._revisions: dict[str, int] = {}  # drain's thread only (and `seen` before it runs)
        self._diverged: set[str] = set()
        self.error: str | None = None  # the current failure; None while writes succeed

    def seen(self, session_id: str, revision: int) -> None:
        """The revision a session had when it was loaded."""
        self._revisions[session_id] = revision

    def add(
        self,
        session: SessionRecord,
        messages: Sequence[MessageRecord] = (),
        removed: Sequence[str] = (),
    ) -> None:
        newer = PendingSession(session, {m.id: m for m in messages}, list(removed))
        with self._lock:
            pending = self._pending.get(session.id)
            if pending is None:
                self._pending[session.id] = newer
            else:
                pending.merge(newer)

    def pending(self) -> list[PendingSession]:
        """What is not stored yet (a copy; what a running drain writes included)."""
        with self._lock:
            out: dict[str, PendingSession] = {}
            for source in (self._in_flight, self._pending):
                for session_id, p in source.items():
                    copy = PendingSession(p.session, dict(p.messages), list(p.removed))
                    if session_id in out:
                        out[session_id].merge(copy)
                    else:
                        out[session_id] = copy
            return list(out.values())

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending or self._in_flight)

    def unsaved_messages(self) -> int:
        return sum(len(p.messages) for p in self.pending())

    def drain(self) -> DrainResult:
        """Write every pending session, one transaction each; stop at the first failure."""
        with self._lock:
            batch, self._pending = self._pending, {}
            self._in_flight = dict(batch)
        error: str | None = None
        diverged: list[str] = []
        for session_id, pending in batch.items():
            if error is None:
                try:
                    result = self._store.save(
                        pending.session,
                        list(pending.messages.values()),
                        removed=pending.removed,
                        expected_revision=self._revisions.get(session_id),
                        ids_stale=session_id in self._diverged,
                    )
                except (sqlite3.Error, OSError) as exc:
                    error = f"{exc} ({type(exc).__name__})"
                else:
                    with self._lock:
                        del self._in_flight[session_id]
                    self._revisions[session_id] = result.revision
                    if result.foreign and session_id not in self._diverged:
                        self._diverged.add(session_id)
                        diverged.append(session_id)
                    continue
            self._put_back(session_id, pending)
        self.error = error
        return DrainResult(error, self.unsaved_messages(), tuple(diverged))

    def _put_back(self, session_id: str, pending: PendingSession) -> None:
        """A failed snapshot goes back under whatever was added since (which is newer)."""
        with self._lock:
            newer = self._pending.get(session_id)
            if newer is not None:
                pending.merge(newer)
            self._pending[session_id] = pending
            del self._in_flight[session_id]
