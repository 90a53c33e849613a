"""kvchat in a real terminal (tmux) for the tmux tests: a `Terminal`, its fixture, waits.

A real terminal gives no events to wait on, so each wait is a bounded loop over
`tmux capture-pane` (0.1 s apart).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 90.0


class Terminal:
    """One tmux session running kvchat; the shell prints KVCHAT-EXITED-<status> when it ends."""

    def __init__(
        self, home: Path, model: Path, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = f"kvchat-test-{uuid.uuid4().hex[:8]}"
        args = [
            sys.executable, "-m", "kvchat", "chat", "--model", str(model), "--dtype", "float32",
            "--device-cache", "16MiB", "--host-cache", "16MiB", "--page-size", "16",
            "--temperature", "0", *extra,
        ]  # fmt: skip
        command = (
            # pytest's COLUMNS/LINES would override the pane's size for Textual
            f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES TERM=xterm-256color "
            f"KVCHAT_HOME={shlex.quote(str(home))} "
            + "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
            + f"{shlex.join(args)}; "
            "echo KVCHAT-EXITED-$?; sleep 600"
        )
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", self.name, "-x", "150", "-y", "45", command],
            check=True,
        )

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def keys(self, *keys: str, literal: bool = False) -> None:
        flags = ["-l"] if literal else []
        subprocess.run(["tmux", "send-keys", "-t", self.name, *flags, *keys], check=True)

    def type(self, text: str) -> None:
        self.keys(text, literal=True)
        self.keys("Enter")

    def wait(self, condition: Callable[[str], bool], what: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")
            time.sleep(0.1)

    def wait_text(self, text: str, timeout: float = 120.0) -> str:
        return self.wait(lambda s: text in s, repr(text), timeout)

    def kvchat_pid(self) -> int:
        shell = subprocess.run(
            ["tmux", "display-message", "-p", "-t", self.name, "#{pane_pid}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        children = subprocess.run(
            ["pgrep", "-P", shell], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 1, children
        return int(children[0])

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False)


@pytest.fixture
def terminals():
    opened: list[Terminal] = []

    def open_terminal(
        home: Path, model: Path, *extra: str, env: dict[str, str] | None = None
    ) -> Terminal:
        terminal = Terminal(home, model, *extra, env=env)
        opened.append(terminal)
        return terminal

    yield open_terminal
    for terminal in opened:
        terminal.close()


def ready(terminal: Terminal) -> str:
    return terminal.wait(
        lambda s: "Sessions" in s and "Hit rate" in s and "starting" not in s,
        "the main screen",
        START_TIMEOUT,
    )
