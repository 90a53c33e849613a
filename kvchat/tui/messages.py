"""The messages worker threads post to the app: start-up, service events, residencies.

Threads never touch a widget (harlequin's rule); they post one of these and the
app handles it on the UI thread.
"""

from __future__ import annotations

from textual.message import Message

from kvchat.chat.events import ChatEvent
from kvchat.chat.service import SessionService
from kvchat.engine.api import Residency
from kvchat.tui.backend import ModelChoice, TuiBackend


class ServiceEvent(Message):
    """A service event (not a reply delta), marshalled to the UI thread."""

    def __init__(self, event: ChatEvent) -> None:
        super().__init__()
        self.event = event


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


class ResidencyReady(Message):
    def __init__(self, residencies: dict[str, Residency]) -> None:
        super().__init__()
        self.residencies = residencies


class SendFailed(Message):
    """The sender thread could not send the composer's message (its text comes back)."""

    def __init__(self, text: str, editing: bool, error: Exception) -> None:
        super().__init__()
        self.text = text
        self.editing = editing
        self.error = error


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
