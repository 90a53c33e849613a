"""Sessions as the store's rows and back: what the service persists and loads.

The service snapshots a session into these records under its lock; `WriteBehind`
stores them later on the worker thread. A message being written is marked with
this process's id (`owner_pid`), so another process's start can tell a reply cut
by a crash from one still streaming.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterable, Sequence

from kvchat.chat.session import (
    Message,
    MessageState,
    Session,
    TurnStats,
    sampling_from_json,
    sampling_to_json,
)
from kvchat.chat.store import MessageRecord, SessionRecord


def session_from_records(record: SessionRecord, messages: Sequence[MessageRecord]) -> Session:
    """A stored session with its messages, as they were written."""
    session = Session(
        id=record.id,
        title=record.title,
        created=record.created,
        updated=record.updated,
        model_fingerprint=record.model_fingerprint,
        sampling=sampling_from_json(record.sampling_json),
        max_tokens=record.max_tokens,
        archived=record.archived,
        deleted_at=record.deleted_at,
        ids=record.ids(),
        ids_stale=record.ids_stale,
        number=record.number,
        unsent=record.unsent,
        model_name=record.model_name,
    )
    for m in messages:
        session.messages.append(
            Message(
                id=m.id,
                role=m.role,
                content=m.content,
                state=MessageState(m.state),
                offset=m.offset,
                ended_with_stop=m.ended_with_stop,
                in_context=m.in_context,
                stats=TurnStats.from_json(json.loads(m.stats_json)) if m.stats_json else None,
                created=m.created,
            )
        )
    return session


def session_record(session: Session, extra_ids: Iterable[int] = ()) -> SessionRecord:
    """The session's row: its fields and token ids (plus `extra_ids` not yet in them)."""
    ids = array("I", session.ids)
    ids.extend(extra_ids)
    return SessionRecord(
        id=session.id,
        title=session.title,
        created=session.created,
        updated=session.updated,
        archived=session.archived,
        deleted_at=session.deleted_at,
        model_fingerprint=session.model_fingerprint,
        token_ids=ids.tobytes(),
        ids_stale=session.ids_stale,
        sampling_json=sampling_to_json(session.sampling),
        max_tokens=session.max_tokens,
        number=session.number,
        unsent=session.unsent,
        model_name=session.model_name,
    )


def message_records(session: Session, messages: Iterable[Message]) -> list[MessageRecord]:
    """Rows for `messages` of `session`, numbered by their place in it."""
    seq = {m.id: i for i, m in enumerate(session.messages)}
    pid = os.getpid()
    return [
        MessageRecord(
            id=m.id,
            seq=seq[m.id],
            role=m.role,
            content=m.content,
            state=str(m.state),
            stats_json=json.dumps(m.stats.to_json()) if m.stats else None,
            offset=m.offset,
            ended_with_stop=m.ended_with_stop,
            in_context=m.in_context,
            owner_pid=pid if m.state == MessageState.STREAMING else None,
            created=m.created,
        )
        for m in messages
    ]
