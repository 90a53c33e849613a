"""`SaveBanner`: a line over the transcript while the session database refuses writes.

Why a banner and not a notification: a notification fades, and a user who missed
it would type on believing every turn is stored. The banner stays until saving
works again; it says what failed, how much waits, and what quitting does with it.
"""

from __future__ import annotations

from textual.widgets import Static


class SaveBanner(Static):
    """Hidden while writes succeed; `show_failure` and `clear_failure` toggle it."""

    DEFAULT_CSS = """
    SaveBanner { display: none; height: auto; padding: 0 1; background: $error;
                 color: $text; text-style: bold; }
    SaveBanner.-failing { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.failing = False

    def show_failure(self, error: str, unsaved_messages: int, retry_s: float) -> None:
        waiting = f"{unsaved_messages} message{'' if unsaved_messages == 1 else 's'}"
        self.update(
            f"NOT SAVED: the session database refuses writes ({error}). {waiting} wait; "
            f"kvchat retries every {retry_s:g} s. Quitting now writes them to a recovery "
            "file and prints its path."
        )
        self.failing = True
        self.add_class("-failing")

    def clear_failure(self) -> None:
        self.failing = False
        self.remove_class("-failing")
        self.update("")
