"""In a real terminal (tmux): pasted text is computed ahead and the composer's border fills.

Polls `tmux capture-pane` as the other tmux tests do (a real terminal gives no
events to wait on).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.tmux_helpers import Terminal, ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

PART = "def double(x):\n    return x * 2\n\n" * 6


def paste(terminal: Terminal, text: str) -> None:
    """A bracketed paste, as a terminal sends a clipboard's text."""
    subprocess.run(
        ["tmux", "load-buffer", "-b", terminal.name, "-"], input=text.encode(), check=True
    )
    subprocess.run(
        ["tmux", "paste-buffer", "-p", "-d", "-b", terminal.name, "-t", terminal.name], check=True
    )


def ready_tokens(screen: str) -> int | None:
    found = re.findall(r"([\d,]+) tokens ready", screen)
    return int(found[-1].replace(",", "")) if found else None


def test_the_ready_indicator_fills_as_text_is_pasted(tmp_path, tiny_llama_dir, terminals):
    term = terminals(tmp_path / "home", tiny_llama_dir)
    ready(term)
    term.keys("C-n")  # a session to type into
    term.wait_text("Type a message below")
    paste(term, PART)
    first = ready_tokens(
        term.wait(lambda s: bool(ready_tokens(s)), "the first paste computed ahead")
    )
    assert first
    paste(term, PART)
    term.wait(
        lambda s: (ready_tokens(s) or 0) > first, "the indicator to grow with the second paste"
    )
    term.keys("Enter")
    term.wait(lambda s: "Assistant" in s and ready_tokens(s) is None, "the message sent")
    term.keys("C-q")
    term.wait_text("KVCHAT-EXITED-0")
