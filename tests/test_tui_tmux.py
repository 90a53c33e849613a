"""kvchat in a real terminal (tmux): type, watch the reply stream, switch, quit, restore; kill -9.

The only tests that poll with short waits: a real terminal gives no events to
wait on, so each wait is a bounded loop over `tmux capture-pane` (0.1 s apart).
Each start imports torch and loads a tiny random model (a few seconds on CPU).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = 90.0


class Terminal:
    """One tmux session running kvchat; the shell prints KVCHAT-EXITED-<status> when it ends."""

    def __init__(self, home: Path, model: Path, *extra: str) -> None:
        self.name = f"kvchat-test-{uuid.uuid4().hex[:8]}"
        args = [
            sys.executable, "-m", "kvchat", "chat", "--model", str(model), "--dtype", "float32",
            "--device-cache", "16MiB", "--host-cache", "16MiB", "--page-size", "16",
            "--temperature", "0", *extra,
        ]  # fmt: skip
        command = (
            # pytest's COLUMNS/LINES would override the pane's size for Textual
            f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES TERM=xterm-256color "
            f"KVCHAT_HOME={shlex.quote(str(home))} {shlex.join(args)}; "
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

    def wait(self, condition: Callable[[str], bool], what: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if condition(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen was:\n{screen}")
            time.sleep(0.1)

    def wait_text(self, text: str, timeout: float = 30.0) -> str:
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

    def open_terminal(home: Path, model: Path, *extra: str) -> Terminal:
        terminal = Terminal(home, model, *extra)
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


def idle_rows(screen: str) -> int:
    return screen.count(" idle ")


def replies_done(screen: str, sessions: int) -> bool:
    """Every session idle and no reply on screen still being written (wait for the reply
    to start first: before the app takes the message, its session is idle too)."""
    return idle_rows(screen) == sessions and "writing…" not in screen


def test_type_stream_switch_quit_and_restore(tmp_path, tiny_llama_dir, terminals):
    home = tmp_path / "home"
    term = terminals(home, tiny_llama_dir, "--max-tokens", "600")
    ready(term)
    term.type("hello there")
    streaming = term.wait(lambda s: "decoding" in s or "Assistant" in s, "the reply starting")
    screens = [streaming]
    done = term.wait(
        lambda s: screens.append(s) is None and "Assistant" in s and replies_done(s, 1),
        "the first reply to end",
    )
    assert "hello there" in done
    assert any("decoding" in s for s in screens), "the reply was seen streaming"

    term.keys("C-n")
    term.wait_text("Type a message below")
    term.type("second chat")
    term.wait(lambda s: "Assistant" in s, "the second reply starting")  # not just typed
    term.wait(lambda s: "second chat" in s and replies_done(s, 2), "the second reply to end")
    term.keys("M-Up")  # alt+up: the previous (older) session
    term.wait(lambda s: "╭─ hello there ─" in s, "switch to the first session")
    term.keys("C-NPage")  # ctrl+pagedown: back to the newer one
    term.wait(lambda s: "╭─ second chat ─" in s, "switch back")
    term.keys("C-q")
    term.wait_text("KVCHAT-EXITED-0")

    again = terminals(home, tiny_llama_dir)
    screen = ready(again)
    screen = again.wait(lambda s: "hello there" in s and "second chat" in s, "sessions restored")
    assert "interrupted" not in screen
    again.keys("C-q")
    again.wait_text("KVCHAT-EXITED-0")


def test_kill_during_a_reply_keeps_the_partial_reply_marked_interrupted(
    tmp_path, tiny_llama_dir, terminals
):
    home = tmp_path / "home"
    term = terminals(home, tiny_llama_dir, "--max-tokens", "1800")
    ready(term)
    term.type("a long story")
    term.wait_text("decoding")
    time.sleep(0.5)  # let the store write part of the reply (it saves every 0.25 s)
    os.kill(term.kvchat_pid(), signal.SIGKILL)
    term.wait_text("KVCHAT-EXITED-137")

    again = terminals(home, tiny_llama_dir)
    ready(again)
    screen = again.wait_text("interrupted")
    assert "a long story" in screen
    assert "Assistant · interrupted" in screen
    again.keys("C-q")
    again.wait_text("KVCHAT-EXITED-0")


def test_alt_digit_switches_sessions_in_tmux(tmp_path, tiny_llama_dir, terminals):
    """tmux sends alt+N as ESC N (the meta-sends-escape form screen and xterm use too);
    it must switch to session N, never type a character into the composer."""
    term = terminals(tmp_path / "home", tiny_llama_dir, "--max-tokens", "4")
    ready(term)
    for n, name in enumerate(("first chat", "second chat", "third chat"), 1):
        if n > 1:
            term.keys("C-n")
            term.wait_text("Type a message below")
        term.type(name)
        term.wait(lambda s, name=name, n=n: f"╭─ {name} ─" in s and replies_done(s, n), name)
    for digit, name in (("1", "first chat"), ("3", "third chat"), ("2", "second chat")):
        term.keys(f"M-{digit}")
        screen = term.wait(lambda s, name=name: f"╭─ {name} ─" in s, f"alt+{digit}: {name}")
    for mac_character in "¡™£":
        assert mac_character not in screen
    term.keys("C-q")
    term.wait_text("KVCHAT-EXITED-0")
