"""Headless `draft` and `pause`: built as `say` builds its text, checked at parse, no reply."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.testing.fake_engine import CharRenderer, FakeEngine
from tests.headless_helpers import run


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


def test_a_type_ahead_then_a_say_that_extends_it_reuses_the_type_aheads_tokens(
    tmp_path: Path,
) -> None:
    (tmp_path / "doc.txt").write_text("DOCUMENT")
    code, events, errors, engine, _ = run(
        tmp_path,
        [
            {"op": "new", "session": "a"},
            {"op": "new", "session": "b"},
            {"op": "draft", "session": "a", "file": "doc.txt", "text": "What is"},
            {"op": "pause", "seconds": 0.2},
            {"op": "say", "session": "a", "file": "doc.txt", "text": "What is it?"},
            {"op": "say", "session": "b", "text": "no draft here"},
            {"op": "wait"},
        ],
    )
    assert code == 0 and errors == []
    # a type-ahead prints no reply event; every reply carries draft_tokens
    replies = {r["session"]: r for r in events if r["event"] == "reply"}
    assert sorted(replies) == ["a", "b"] and len(events) == 2
    (ahead,) = engine.type_aheads
    expected = CharRenderer().type_ahead_ids([], "DOCUMENT\n\nWhat is", reply_ended_with_stop=False)
    assert list(ahead) == expected  # the file's text, a blank line, then the text
    assert replies["a"]["draft_tokens"] == len(ahead)
    assert replies["a"]["draft_tokens"] <= replies["a"]["cached_tokens"]["device"]
    assert replies["b"]["draft_tokens"] == 0


def test_a_later_type_ahead_replaces_the_earlier_one(tmp_path: Path) -> None:
    engine = FakeEngine(manual=True)
    code, events, errors, engine, _ = run(
        tmp_path,
        [
            {"op": "new", "session": "a"},
            {"op": "draft", "session": "a", "text": "first guess"},
            {"op": "draft", "session": "a", "text": "second guess"},
        ],
        engine=engine,
    )
    assert code == 0 and errors == [] and events == []
    assert len(engine.type_aheads) == 2 and engine.replaced_ids == [1]
    assert engine.cancelled_ids == [2]  # the end of the script ends the live type-ahead


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"op": "draft", "session": "a"}', 'op "draft" needs "text" or "file"'),
        ('{"op": "draft", "session": "a", "file": "nope.txt"}', "cannot read file"),
        ('{"op": "draft", "session": "zz", "text": "x"}', "unknown session 'zz'"),
        ('{"op": "draft", "session": "a", "text": "x", "max_tokens": 3}', "unknown key"),
        ('{"op": "pause"}', "op 'pause' needs 'seconds'"),
        ('{"op": "pause", "seconds": -1}', "'seconds' must be a number at least 0"),
        ('{"op": "pause", "seconds": "2"}', "'seconds' must be"),
    ],
)
def test_bad_type_ahead_and_pause_lines_are_refused_before_anything_runs(
    tmp_path: Path, line: str, message: str
) -> None:
    lines = [{"op": "new", "session": "a"}, {"op": "pause", "seconds": 0}, "", line]
    code, events, errors, _engine, started = run(tmp_path, lines)
    assert code == 2 and events == [] and not started
    (error,) = errors
    assert error["line"] == 4 and message in error["message"]
