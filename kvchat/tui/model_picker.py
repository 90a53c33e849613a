"""The model picker (f5): the models on this machine, the one running marked, the ones
kvchat cannot run shown with the reason and not selectable.

The list comes from the backend (`TuiBackend.models`), so the TUI never reads model
files or imports torch; choosing one returns its name, which the app hands to
`TuiBackend.switch`.
"""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from kvchat.tui.backend import ModelChoice


def choice_text(choice: ModelChoice) -> str:
    mark = "● " if choice.current else "  "
    text = f"{mark}{choice.name}  [dim]{choice.source} · {choice.detail}[/]"
    if choice.reason:
        text += f"\n    [dim]cannot run: {choice.reason}[/]"
    return text


class ModelPicker(ModalScreen[str | None]):
    """Pick a model; enter switches to it, escape keeps the one running."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Cancel", priority=True)]

    def __init__(self, choices: tuple[ModelChoice, ...]):
        super().__init__()
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Run another model (new turns use it)", id="dialog-title")
            options = [
                Option(choice_text(c), id=c.name, disabled=c.reason is not None)
                for c in self.choices
            ]
            yield OptionList(*options, id="model-list")
            yield Label(
                "enter switches (sessions keep their history), escape cancels; "
                "kvchat models lists the same",
                id="dialog-hint",
            )

    def on_mount(self) -> None:
        listing = self.query_one(OptionList)
        listing.focus()
        for index, choice in enumerate(self.choices):
            if choice.current:
                listing.highlighted = index

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        chosen = event.option.id
        current = next((c.name for c in self.choices if c.current), None)
        self.dismiss(None if chosen == current else chosen)

    def action_cancel(self) -> None:
        self.dismiss(None)
