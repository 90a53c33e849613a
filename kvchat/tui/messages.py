"""The messages threads post to the UI, each named for what the UI does with it.

Threads never touch a widget (harlequin's rule); they post one of these and a screen
or the app handles it on the UI thread. Start-up and model switching go to the app,
which owns the backend; everything about the sessions goes to the chat screen.
How each service event becomes one of these: `service_events`.
"""

from __future__ import annotations

from textual.message import Message

from kvchat.chat.events import SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.session import SessionSnapshot, SessionView
from kvchat.engine.api import Residency
from kvchat.tui.backend import ModelChoice, TuiBackend

# ------------------------------------------------------------------ start-up (to the app)


class StartProgress(Message):
    def __init__(self, line: str) -> None:
        super().__init__()
        self.line = line


class BackendReady(Message):
    def __init__(self, backend: TuiBackend, service: SessionService, interrupted: int) -> None:
        super().__init__()
        self.backend = backend
        self.service = service
        self.interrupted = interrupted


class StartFailed(Message):
    def __init__(self, text: str, exit_code: int = 1) -> None:
        super().__init__()
        self.text = text
        self.exit_code = exit_code  # 2: bad input (an option or a setting), as the CLI's


class ModelsListed(Message):
    """The models the picker offers, listed off the UI thread (it reads their files)."""

    def __init__(self, choices: tuple[ModelChoice, ...]) -> None:
        super().__init__()
        self.choices = choices


class BackendSwitched(Message):
    """Another model's backend now serves the sessions; `name` is the one chosen."""

    def __init__(self, backend: TuiBackend, name: str) -> None:
        super().__init__()
        self.backend = backend
        self.name = name


# --------------------------------------------------------- the sessions (to the chat screen)


class ResidencyReady(Message):
    """Where the listed sessions' pages live, read off the UI thread; shown at the next tick."""

    def __init__(self, residencies: dict[str, Residency]) -> None:
        super().__init__()
        self.residencies = residencies


class ShowTokensReady(Message):
    """A session's type-ahead moved: the composer's "N tokens ready" (None: none)."""

    def __init__(self, session_id: str, label: str | None) -> None:
        super().__init__()
        self.session_id = session_id
        self.label = label


class ShowSaveFailure(Message):
    """Writing to the session database failed: the banner says so until it works again."""

    def __init__(self, error: str, unsaved_messages: int) -> None:
        super().__init__()
        self.error = error
        self.unsaved_messages = unsaved_messages


class ClearSaveFailure(Message):
    """Saving works again: the banner goes, a notice says every message is stored."""


class RelistSessions(Message):
    """A session was created, archived, deleted or brought back: the sidebar is rebuilt."""


class ReportSessionFailure(Message):
    """A session's turn could not start: its text back to the composer when it was refused
    as it was sent, else a notification that names the session."""

    def __init__(self, failure: SessionFailed) -> None:
        super().__init__()
        self.failure = failure


class ShowSessionNotice(Message):
    """Something to tell about a session: a notification if it is the one shown."""

    def __init__(self, session_id: str, text: str, view: SessionView) -> None:
        super().__init__()
        self.session_id = session_id
        self.text = text
        self.view = view  # the session when it was said


class RedrawSession(Message):
    """A session's title, messages or state changed: its row, and its transcript if shown,
    from the snapshot the event carried."""

    def __init__(self, snapshot: SessionSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class FinishReply(Message):
    """A reply ended: its last text is flushed, the transcript and the meters catch up."""

    def __init__(self, snapshot: SessionSnapshot, message_id: str) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.message_id = message_id
