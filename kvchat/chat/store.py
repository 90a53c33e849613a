"""SQLite persistence of sessions, messages and their token ids.

Why SQLite and these settings: two kvchat processes (a TUI and a `kvchat run
--save`) may write one database at once. WAL lets readers and one writer work
together, `busy_timeout` makes a second writer wait instead of failing, and
every change is one `BEGIN IMMEDIATE` transaction, so a crash or `kill -9`
leaves the previous consistent state. Token ids are stored as a BLOB of
`array('I')` (4 bytes a token, native order, with the order recorded).

Two processes may append to one session (each loaded it before the other
wrote): a message's `seq` is therefore allocated inside the write transaction
(after every message already stored; a new system prompt before them), a
removal names the message ids it drops (never a range of seqs that may hold
another process's turn), and each session row carries a `revision` so a writer
learns that someone else wrote the session since it last did (`SaveResult`).

A reply is saved while it streams with state `streaming` and its writer's pid;
opening a store marks the streaming messages whose writer is gone as
`interrupted`, so a partial reply is kept and shown, never lost or left looking
alive. The schema is versioned by `PRAGMA user_version` and the `_MIGRATIONS`
list: migration i brings the schema from version i to i + 1.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.chat.database_access import open_failure_message
from kvchat.errors import KvchatError
from kvchat.processes import pid_alive

_MIGRATIONS: list[str] = [
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        archived INTEGER NOT NULL DEFAULT 0,
        deleted_at REAL,
        model_fingerprint TEXT NOT NULL DEFAULT '',
        token_ids BLOB NOT NULL DEFAULT x'',
        ids_byteorder TEXT NOT NULL DEFAULT 'little',
        ids_stale INTEGER NOT NULL DEFAULT 0,
        sampling TEXT,
        max_tokens INTEGER
    );
    CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        state TEXT NOT NULL,
        stats TEXT,
        id_offset INTEGER,
        ended_with_stop INTEGER NOT NULL DEFAULT 0,
        in_context INTEGER NOT NULL DEFAULT 1,
        owner_pid INTEGER,
        created REAL NOT NULL,
        UNIQUE (session_id, seq)
    );
    CREATE INDEX messages_streaming ON messages(state) WHERE state = 'streaming';
    """,
    """
    ALTER TABLE sessions ADD COLUMN revision INTEGER NOT NULL DEFAULT 0;
    """,
    # the session's number in the list (alt+N), kept for its life; 0: not given yet
    """
    ALTER TABLE sessions ADD COLUMN number INTEGER NOT NULL DEFAULT 0;
    """,
    # what the user typed in the session's composer and has not sent
    """
    ALTER TABLE sessions ADD COLUMN unsent TEXT NOT NULL DEFAULT '';
    """,
    # the name of the model its last turn ran on (what --model took), for "it is gone"
    """
    ALTER TABLE sessions ADD COLUMN model_name TEXT NOT NULL DEFAULT '';
    """,
]

SCHEMA_VERSION = len(_MIGRATIONS)
BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class SessionRecord:
    id: str
    title: str
    created: float
    updated: float
    archived: bool
    deleted_at: float | None
    model_fingerprint: str
    token_ids: bytes  # array('I').tobytes(), native order
    ids_stale: bool
    sampling_json: str | None
    max_tokens: int | None
    revision: int = 0  # bumped by every save; ignored when writing
    number: int = 0  # its place in the list, for alt+N (0: none given yet)
    unsent: str = ""  # the composer's text not sent yet
    model_name: str = ""  # the model its last turn ran on ("": none yet, or before names)

    def ids(self) -> array:
        out = array("I")
        out.frombytes(self.token_ids)
        return out


@dataclass(frozen=True)
class MessageRecord:
    id: str
    seq: int  # the order when loaded; a save allocates it (see the module docstring)
    role: str
    content: str
    state: str
    stats_json: str | None
    offset: int | None
    ended_with_stop: bool
    in_context: bool
    owner_pid: int | None
    created: float


@dataclass(frozen=True)
class SaveResult:
    revision: int  # the session's revision after this save
    foreign: bool  # another writer saved the session since the revision the caller expected


class Store:
    """One connection to one database; methods are safe from any thread (a lock serialises them)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._lock = threading.RLock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                self.path,
                timeout=BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,  # we open transactions ourselves
                check_same_thread=False,
            )
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if self.path != ":memory:":
                self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
            self.interrupted_on_open = self.mark_interrupted()
        except (sqlite3.DatabaseError, PermissionError) as exc:
            raise KvchatError(open_failure_message(Path(self.path), exc)) from exc

    @classmethod
    def in_memory(cls) -> Store:
        """An ephemeral store (headless runs without --save)."""
        return cls(":memory:")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db.in_transaction:  # a failed COMMIT or ROLLBACK left one open
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # the error that matters is the one raised inside; a ROLLBACK that fails
                # too (disk I/O error) must not hide it
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise

    def _migrate(self) -> None:
        with self._transaction() as db:  # IMMEDIATE: two processes never migrate at once
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise KvchatError(
                    f"the session database {self.path} was written by a newer kvchat "
                    f"(schema {version}, this one knows {SCHEMA_VERSION}); upgrade kvchat"
                )
            for step in _MIGRATIONS[version:]:
                for statement in step.split(";"):
                    if statement.strip():
                        db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def mark_interrupted(self) -> int:
        """Mark `streaming` messages whose writing process is gone as `interrupted`."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT id, owner_pid FROM messages WHERE state = 'streaming'"
            ).fetchall()
            dead = [(mid,) for mid, pid in rows if pid is None or not pid_alive(int(pid))]
            db.executemany(
                "UPDATE messages SET state = 'interrupted', owner_pid = NULL WHERE id = ?", dead
            )
        return len(dead)

    def save(
        self,
        session: SessionRecord,
        messages: Sequence[MessageRecord] = (),
        *,
        removed: Sequence[str] = (),
        expected_revision: int | None = None,
        ids_stale: bool = False,
    ) -> SaveResult:
        """One transaction: upsert the session row and `messages`, delete the `removed` ids.

        A message already stored keeps its seq; a new one goes after every stored message
        of the session (a system message before them). `expected_revision` is the revision
        the caller's last save returned (None: it never saved this session); when the row
        moved on since, the result says `foreign` and the caller's token ids, which do not
        render the other writer's turns, are stored as stale. `ids_stale` forces that too.
        """
        byteorder = sys.byteorder
        with self._transaction() as db:
            row = db.execute("SELECT revision FROM sessions WHERE id = ?", (session.id,)).fetchone()
            current = None if row is None else int(row[0])
            foreign = current is not None and current != expected_revision
            revision = (current or 0) + 1
            db.execute(
                """INSERT INTO sessions (id, title, created, updated, archived, deleted_at,
                       model_fingerprint, token_ids, ids_byteorder, ids_stale, sampling, max_tokens,
                       revision, number, unsent, model_name)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(id) DO UPDATE SET title = excluded.title,
                       updated = excluded.updated, archived = excluded.archived,
                       deleted_at = excluded.deleted_at,
                       model_fingerprint = excluded.model_fingerprint,
                       token_ids = excluded.token_ids, ids_byteorder = excluded.ids_byteorder,
                       ids_stale = excluded.ids_stale, sampling = excluded.sampling,
                       max_tokens = excluded.max_tokens, revision = excluded.revision,
                       number = excluded.number, unsent = excluded.unsent,
                       model_name = excluded.model_name""",
                (
                    session.id,
                    session.title,
                    session.created,
                    session.updated,
                    int(session.archived),
                    session.deleted_at,
                    session.model_fingerprint,
                    session.token_ids,
                    byteorder,
                    int(session.ids_stale or ids_stale or foreign),
                    session.sampling_json,
                    session.max_tokens,
                    revision,
                    session.number,
                    session.unsent,
                    session.model_name,
                ),
            )
            if removed:
                db.executemany(
                    "DELETE FROM messages WHERE session_id = ? AND id = ?",
                    [(session.id, mid) for mid in removed],
                )
            for m in messages:
                values = (
                    m.content,
                    m.state,
                    m.stats_json,
                    m.offset,
                    int(m.ended_with_stop),
                    int(m.in_context),
                    m.owner_pid,
                )
                updated = db.execute(
                    """UPDATE messages SET content = ?, state = ?, stats = ?, id_offset = ?,
                           ended_with_stop = ?, in_context = ?, owner_pid = ?
                       WHERE id = ? AND session_id = ?""",
                    (*values, m.id, session.id),
                )
                if updated.rowcount:
                    continue
                low, high = db.execute(
                    "SELECT MIN(seq), MAX(seq) FROM messages WHERE session_id = ?", (session.id,)
                ).fetchone()
                if high is None:
                    seq = 0
                elif m.role == "system":
                    seq = low - 1
                else:
                    seq = high + 1
                db.execute(
                    """INSERT INTO messages (id, session_id, seq, role, content, state, stats,
                           id_offset, ended_with_stop, in_context, owner_pid, created)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (m.id, session.id, seq, m.role, *values, m.created),
                )
        return SaveResult(revision, foreign)

    def revision(self, session_id: str) -> int | None:
        """The session row's revision (None: no such row)."""
        with self._lock:
            row = self._db.execute(
                "SELECT revision FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
        return None if row is None else int(row[0])

    def purge_deleted(self, before: float) -> int:
        """Remove for good the sessions soft-deleted before `before` (time.time())."""
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM sessions WHERE deleted_at IS NOT NULL AND deleted_at < ?", (before,)
            )
            return cursor.rowcount

    def delete_session(self, session_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def load(self) -> list[tuple[SessionRecord, list[MessageRecord]]]:
        """Every session (soft-deleted ones included) with its messages in order."""
        with self._lock:
            sessions = self._db.execute(
                """SELECT id, title, created, updated, archived, deleted_at, model_fingerprint,
                          token_ids, ids_byteorder, ids_stale, sampling, max_tokens, revision,
                          number, unsent, model_name
                   FROM sessions ORDER BY created"""
            ).fetchall()
            out = []
            for row in sessions:
                blob = bytes(row[7])
                if row[8] != sys.byteorder:  # a database moved between machines
                    ids = array("I")
                    ids.frombytes(blob)
                    ids.byteswap()
                    blob = ids.tobytes()
                record = SessionRecord(
                    id=row[0],
                    title=row[1],
                    created=row[2],
                    updated=row[3],
                    archived=bool(row[4]),
                    deleted_at=row[5],
                    model_fingerprint=row[6],
                    token_ids=blob,
                    ids_stale=bool(row[9]),
                    sampling_json=row[10],
                    max_tokens=row[11],
                    revision=row[12],
                    number=row[13],
                    unsent=row[14],
                    model_name=row[15],
                )
                messages = [
                    MessageRecord(
                        id=m[0],
                        seq=m[1],
                        role=m[2],
                        content=m[3],
                        state=m[4],
                        stats_json=m[5],
                        offset=m[6],
                        ended_with_stop=bool(m[7]),
                        in_context=bool(m[8]),
                        owner_pid=m[9],
                        created=m[10],
                    )
                    for m in self._db.execute(
                        """SELECT id, seq, role, content, state, stats, id_offset,
                                  ended_with_stop, in_context, owner_pid, created
                           FROM messages WHERE session_id = ? ORDER BY seq""",
                        (record.id,),
                    )
                ]
                out.append((record, messages))
            return out

    def integrity_ok(self) -> bool:
        with self._lock:
            return self._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
