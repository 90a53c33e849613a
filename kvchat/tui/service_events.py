"""What each service event does to the UI: reply text is buffered, the rest become messages.

Runs on the service's worker thread, so it never touches a widget: a `ReplyDelta`
goes into the `StreamBuffer` (the frame pump shows it at its next tick, nothing runs
per token on the UI thread) and every other event is posted to the chat screen as the
message named for its effect:

| event | message |
|---|---|
| `TypeAheadChanged` | `ShowTokensReady` |
| `SaveFailed` / `SaveRecovered` | `ShowSaveFailure` / `ClearSaveFailure` |
| `SessionCreated`, `SessionArchived`, `SessionDeleted` | `RelistSessions` |
| `SessionFailed` | `ReportSessionFailure` |
| `SessionNotice` | `ShowSessionNotice` |
| `SessionChanged`, `SessionRenamed`, `ReplyStarted` | `RedrawSession` |
| `ReplyFinished` | `FinishReply` |

Events with the same effect share its message, so each effect has one handler. An
event about a session carries its snapshot, and so does its message: the handlers
show it without reading the session back from the service.
"""

from __future__ import annotations

from collections.abc import Callable

from textual.message import Message

from kvchat.chat.events import (
    ChatEvent,
    ReplyDelta,
    ReplyFinished,
    ReplyStarted,
    SaveFailed,
    SaveRecovered,
    SessionArchived,
    SessionChanged,
    SessionCreated,
    SessionDeleted,
    SessionFailed,
    SessionNotice,
    SessionRenamed,
    TypeAheadChanged,
)
from kvchat.tui.messages import (
    ClearSaveFailure,
    FinishReply,
    RedrawSession,
    RelistSessions,
    ReportSessionFailure,
    ShowSaveFailure,
    ShowSessionNotice,
    ShowTokensReady,
)
from kvchat.tui.stream_buffer import StreamBuffer
from kvchat.tui.type_ahead import ready_label


def message_for(event: ChatEvent) -> Message:
    """The UI message for a service event other than a reply delta."""
    if isinstance(event, TypeAheadChanged):
        return ShowTokensReady(
            event.session_id, ready_label(event.ready_tokens, event.total_tokens)
        )
    if isinstance(event, SaveFailed):
        return ShowSaveFailure(event.error, event.unsaved_messages)
    if isinstance(event, SaveRecovered):
        return ClearSaveFailure()
    if isinstance(event, SessionCreated | SessionArchived | SessionDeleted):
        return RelistSessions()
    if isinstance(event, SessionFailed):
        return ReportSessionFailure(event)
    if isinstance(event, SessionNotice):
        return ShowSessionNotice(event.session_id, event.text, event.snapshot.view)
    if isinstance(event, ReplyFinished):
        return FinishReply(event.snapshot, event.message_id)
    if isinstance(event, SessionChanged | SessionRenamed | ReplyStarted):
        return RedrawSession(event.snapshot)
    raise TypeError(f"no UI message for {type(event).__name__}")


def relay_to(
    buffer: StreamBuffer, post: Callable[[Message], object]
) -> Callable[[ChatEvent], None]:
    """The service subscriber: reply text into `buffer`, every other event `post`ed."""

    def relay(event: ChatEvent) -> None:
        if isinstance(event, ReplyDelta):
            buffer.add(event.session_id, event.message_id, event.text, len(event.token_ids))
        else:
            post(message_for(event))

    return relay
