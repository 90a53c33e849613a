"""`Persistence`: the service's write-behind saving of sessions.

A change is snapshotted under the service's lock (`persist`) and written later on
the service's worker thread (`drain`), so neither the engine thread nor the UI
thread waits on the disk. What the database refuses stays pending
(`write_behind.py`) and is retried; subscribers hear when saving fails and when it
works again; a session another kvchat process also wrote gets a notice; and what is
still unsaved when the service closes goes to a recovery file (`recovery.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from kvchat.chat.events import ChatEvent, SaveFailed, SaveRecovered, SessionNotice
from kvchat.chat.live_sessions import LiveSessions
from kvchat.chat.recovery import UnsavedReport, write_recovery
from kvchat.chat.session import Message, Session
from kvchat.chat.session_records import message_records, session_record
from kvchat.chat.store import Store
from kvchat.chat.write_behind import WriteBehind

log = logging.getLogger("kvchat.chat")

DIVERGED_NOTICE = (
    "Another kvchat process also wrote to this session: every message of both is saved; "
    "restart kvchat to see them all here."
)


class Persistence:
    """Snapshots under the lock (`persist`), writes on the worker (`drain`)."""

    def __init__(self, store: Store, live: LiveSessions) -> None:
        self.store = store
        self._live = live
        self._writes = WriteBehind(store)
        self._reported: tuple[str, int] | None = None  # the save failure last published
        self.request_drain = lambda: None  # set by the service: queue `drain` on the worker

    @property
    def error(self) -> str | None:
        """The database's current write failure (None while writes succeed)."""
        return self._writes.error

    def unsaved_messages(self) -> int:
        return self._writes.unsaved_messages()

    def seen(self, session_id: str, revision: int) -> None:
        """The revision a session had when it was loaded."""
        self._writes.seen(session_id, revision)

    def persist(
        self,
        session: Session,
        messages: Iterable[Message] = (),
        *,
        removed: Iterable[str] = (),
        extra_ids: Iterable[int] = (),
    ) -> None:
        """Snapshot now (under the lock), write later on the worker thread.

        `messages` are the ones that changed (a new one is appended after every stored
        message, a new system prompt before them); `removed` are ids to delete.
        """
        record = session_record(session, extra_ids)
        records = message_records(session, messages)
        self._writes.add(record, records, list(removed))
        self.request_drain()

    def drain(self) -> None:
        """Worker thread: store what waits; tell subscribers when that fails or works again."""
        if not self._writes.has_pending():
            return
        before = self._writes.error
        result = self._writes.drain()
        events: list[ChatEvent] = []
        if result.error is not None:
            if before is None:
                log.error("writing the session database failed: %s", result.error)
            reported = (result.error, result.unsaved_messages)
            if reported != self._reported:
                self._reported = reported
                events.append(SaveFailed(result.error, result.unsaved_messages))
        elif before is not None:
            self._reported = None
            log.warning("writing the session database works again")
            events.append(SaveRecovered())
        live = self._live
        for session_id in result.diverged:
            with live.lock:
                if session_id not in live.runtime:
                    continue
                live.runtime[session_id].notice = DIVERGED_NOTICE
                events.append(SessionNotice(session_id, DIVERGED_NOTICE, live.snapshot(session_id)))
        live.publish(events)

    def close(self) -> UnsavedReport | None:
        """A last try at what waits; what still cannot be stored goes to a recovery file.
        Closes the store. Returns None when everything is stored."""
        report = None
        if self._writes.has_pending():
            self._writes.drain()  # a last try: the fault may have cleared
            path = self.store.path
            folders = [] if path == ":memory:" else [Path(path).parent]
            report = write_recovery(self._writes.pending(), path, self._writes.error, folders)
            if report is not None:
                log.error("unsaved messages at exit: %s", report.summary())
        try:
            self.store.close()
        except Exception:  # closing is best effort: what mattered is written or reported
            log.debug("closing the session store failed", exc_info=True)
        return report
