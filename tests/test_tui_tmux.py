"""kvchat in a real terminal (tmux): type, watch the reply stream, switch, quit, restore; kill -9.

The only tests that poll with short waits: a real terminal gives no events to
wait on, so each wait is a bounded loop over `tmux capture-pane` (0.1 s apart).
Each start imports torch and loads a tiny random model (a few seconds on CPU).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from tests.tmux_helpers import ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


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
