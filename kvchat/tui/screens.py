"""The TUI's other screens: start-up progress, the "cannot start" screen, dialogs and help.

Why a screen for a failed start: a missing or broken model is the most common
first-run problem, and a traceback tells a user nothing; the screen shows the
`KvchatError` message (which says what to do) and a key to quit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Input, Label, LoadingIndicator, Log, Static, TextArea

from kvchat.paths import app_paths
from kvchat.tui.composer import Composer
from kvchat.tui.keys import ALL_KEYS, keys_for
from kvchat.tui.meters import HELP as METERS_HELP
from kvchat.tui.sidebar import HELP as SIDEBAR_HELP


class StartupScreen(Screen[None]):
    """Shown while the model loads (the first run converts the default model: minutes).

    Why it has a composer: a user who starts typing while the model loads must not lose
    the keys. What they type here becomes the main composer's text once kvchat is ready;
    a message sent here (the send key) is sent then, to the session kvchat opens on.
    """

    AUTO_FOCUS = "#startup-composer"
    WAITING_HINT = "You can type your first message now; it is sent once the model is ready."
    QUEUED_HINT = "Your message is sent as soon as the model is ready."

    def __init__(self, keymap: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.keymap = keymap
        self.send_queued = False  # the user sent what they typed: send it once ready

    def compose(self) -> ComposeResult:
        with Vertical(id="startup"):
            yield Label("kvchat is starting: loading the model…", id="startup-title")
            yield LoadingIndicator()
            yield Log(id="startup-log", auto_scroll=True)
            yield Label(self.WAITING_HINT, id="startup-hint")
            yield Composer(keymap=self.keymap, id="startup-composer")

    def progress(self, line: str) -> None:
        self.query_one(Log).write_line(line)

    @property
    def typed(self) -> str:
        """What the user typed here so far ("" before the screen has composed)."""
        composers = self.query("#startup-composer").results(Composer)
        return next((composer.text for composer in composers), "")

    def on_composer_submitted(self, message: Composer.Submitted) -> None:
        message.stop()  # the app cannot send yet: this screen keeps it until it can
        self.send_queued = True
        composer = self.query_one("#startup-composer", Composer)
        composer.read_only = True
        self.query_one("#startup-hint", Label).update(self.QUEUED_HINT)


class FailedStartScreen(Screen[None]):
    """The model (or something else needed to start) failed: what happened and what to do."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("q,escape,ctrl+q", "app.quit", "Quit", priority=True)
    ]

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(id="failed"):
            yield Label("kvchat cannot start", id="failed-title")
            yield Static(self.message, id="failed-message", markup=False)
            yield Label("Press q to quit.", id="failed-hint")


class TextDialog(ModalScreen[str | None]):
    """Ask for one value; enter (ctrl+s when multi-line) accepts, escape cancels."""

    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "cancel", "Cancel", priority=True),
        Binding("ctrl+s", "accept", "Save", priority=True),
    ]

    def __init__(self, title: str, value: str = "", *, hint: str = "", multiline: bool = False):
        super().__init__()
        self.title_text = title
        self.value = value
        self.hint = hint
        self.multiline = multiline

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, id="dialog-title")
            if self.multiline:
                yield TextArea(self.value, id="dialog-input", soft_wrap=True)
            else:
                yield Input(self.value, id="dialog-input", select_on_focus=False)
            hint = self.hint or (
                "ctrl+s saves, escape cancels" if self.multiline else "enter saves, escape cancels"
            )
            yield Label(hint, id="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#dialog-input").focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def action_accept(self) -> None:
        widget = self.query_one("#dialog-input")
        self.dismiss(widget.text if isinstance(widget, TextArea) else widget.value)  # type: ignore[attr-defined]

    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """Every key (as remapped by the settings file), what each glyph and figure on screen
    means, and where kvchat keeps its files."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,f1,q", "dismiss", "Close", priority=True)]

    def __init__(self, keymap: Mapping[str, str]) -> None:
        super().__init__()
        self.keymap = keymap

    def compose(self) -> ComposeResult:
        paths = app_paths()
        rows = [f"{keys_for(s.id, self.keymap):<28} {s.description:<14} ({s.id})" for s in ALL_KEYS]
        text = (
            "Keys (remap them in the settings file's [keys] table by id, e.g. "
            'next_session = "ctrl+right"):\n\n'
            + "\n".join(rows)
            + "\n\nThe command palette (ctrl+p) has every action, plus export, fork, "
            "system prompt, sampling and theme.\n\n" + SIDEBAR_HELP + "\n\n" + METERS_HELP + "\n\n"
            f"Settings: {paths.settings_file}\nThemes:   {paths.themes_dir}\n"
            f"Sessions: {paths.database}\nErrors:   {paths.error_log}"
        )
        with VerticalScroll(id="help"):
            yield Label("kvchat help (escape closes)", id="help-title")
            yield Static(text, markup=False)
