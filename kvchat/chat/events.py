"""What `SessionService` tells its subscribers (frozen: they cross threads).

Callbacks run on the service's worker thread (or the caller's thread for
commands); a UI marshals them to its own loop (`call_from_thread`,
`post_message`) and must not do slow work in the callback. An event about one
session's messages, title or state carries the session's `SessionSnapshot` taken
when it happened, so a subscriber never reads the session back to show it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.chat.session import SessionSnapshot, TurnStats


@dataclass(frozen=True)
class SessionCreated:
    session_id: str


@dataclass(frozen=True)
class SessionRenamed:
    session_id: str
    title: str
    snapshot: SessionSnapshot


@dataclass(frozen=True)
class SessionArchived:
    session_id: str
    archived: bool  # False: brought back


@dataclass(frozen=True)
class SessionDeleted:
    session_id: str
    deleted: bool  # False: the delete was undone


@dataclass(frozen=True)
class SessionChanged:
    """Messages, settings, state or unread flag changed: `snapshot` is the session now."""

    session_id: str
    snapshot: SessionSnapshot


@dataclass(frozen=True)
class SessionNotice:
    """Something the user should be told about a session (not an error)."""

    session_id: str
    text: str
    snapshot: SessionSnapshot


@dataclass(frozen=True)
class ReplyStarted:
    session_id: str
    message_id: str  # the assistant message being written
    turn: int  # 1-based: the number of user messages in the session so far
    snapshot: SessionSnapshot  # the user message and the empty reply included


@dataclass(frozen=True)
class ReplyDelta:
    session_id: str
    message_id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplyFinished:
    session_id: str
    message_id: str
    turn: int
    text: str
    stats: TurnStats
    snapshot: SessionSnapshot  # the reply stored, as it ended


@dataclass(frozen=True)
class SessionFailed:
    """A turn could not start (its prompt did not fit, the renderer failed): nothing of it
    was added to the session.

    `waited` says whether it had waited behind the session's running reply; one that did
    not failed as it was sent, so its `text` can go back to where it was typed.
    """

    session_id: str
    message: str
    snapshot: SessionSnapshot
    turn: int = 0  # the number `SessionService.say` returned for it
    text: str = ""  # the message that was not sent
    edit: bool = False  # it was an edit-and-resend of the last message
    waited: bool = True
    unexpected: str | None = None  # not a KvchatError (a bug): the failure's own text


@dataclass(frozen=True)
class TypeAheadChanged:
    """How much of the session's unsent message is computed ahead (0 of 0: no type-ahead)."""

    session_id: str
    ready_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class SaveFailed:
    """Writing to the session database failed; the service keeps what waits and retries.

    Published when a failure starts and when what waits changes; the UI shows it until
    `SaveRecovered` (what still waits when kvchat stops goes to a recovery file).
    """

    error: str
    unsaved_messages: int


@dataclass(frozen=True)
class SaveRecovered:
    """Writing works again: everything that waited is stored."""


ChatEvent = (
    SessionCreated
    | SessionRenamed
    | SessionArchived
    | SessionDeleted
    | SessionChanged
    | SessionNotice
    | ReplyStarted
    | ReplyDelta
    | ReplyFinished
    | SessionFailed
    | TypeAheadChanged
    | SaveFailed
    | SaveRecovered
)
