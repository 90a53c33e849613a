"""The transcript scrolls from the composer in a real terminal: pageup / pagedown and
ctrl+home / ctrl+end arrive through tmux's key encoding, move the transcript, and leave
the focus and the typed text in the composer.

Textual's Pilot sends key names, not the escape sequences a terminal sends (ctrl+end is
ESC [ 1 ; 5 F), so these keys are checked here as well as in `test_tui_scrolling.py`.
"""

from __future__ import annotations

import shutil

import pytest

from tests.tmux_helpers import ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

FIRST = "first question"


def at_top(screen: str) -> bool:
    """The first question in the transcript itself, at its left edge (the sidebar and the
    transcript's border show it too, as the session's title)."""
    return f"││ {FIRST} " in screen


def past_top(screen: str) -> bool:
    return not at_top(screen)


def test_scroll_keys_move_the_transcript_and_keep_what_is_typed(
    tmp_path, tiny_llama_dir, terminals
):
    term = terminals(tmp_path / "home", tiny_llama_dir)
    ready(term)
    # a tiny random model's replies are short: several turns make a transcript taller
    # than the pane
    for question in (FIRST, "second one", "third one", "fourth one", "fifth one"):
        term.type(question)
        term.wait(
            lambda s, q=question: q in s and " idle " in s and "writing…" not in s,
            f"the reply to {question!r}",
        )
    end = term.wait(past_top, "the transcript's end in view, its top scrolled away")
    term.keys("C-Home")
    top = term.wait(at_top, "ctrl+home: the top")
    term.keys(*"half typed", literal=True)  # the focus stayed in the composer
    term.keys("C-End")
    term.wait(lambda s: past_top(s) and "half typed" in s, "ctrl+end: the end again")
    term.keys("PPage")
    term.wait(lambda s: s != end and "half typed" in s, "pageup: a page up")
    term.keys("NPage", "NPage", "NPage", "NPage", "NPage", "NPage")
    term.wait(lambda s: past_top(s) and "half typed" in s, "pagedown: back at the end")
    term.keys("Enter")
    sent = term.wait(lambda s: s.count("half typed") >= 1 and " idle " in s, "the typed text sent")
    assert top != sent
    term.keys("C-q")
    term.wait_text("KVCHAT-EXITED-0")
