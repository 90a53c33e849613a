"""`kvchat run`: every op on the fake engine, the event fields (docs/architecture.md), bad
scripts, failures."""

from __future__ import annotations

import io
import json

import pytest

from kvchat.chat.engine_port import ChatBackend
from kvchat.headless import run_script
from kvchat.paths import app_paths
from kvchat.testing.fake_engine import END, CharRenderer, FakeEngine
from tests.headless_helpers import run

REPLY_FIELDS = {
    "event",
    "session",
    "turn",
    "text",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "recomputed_tokens",
    "generated_tokens",
    "ttft_s",
    "decode_tok_s",
    "error",
}
STATS_FIELDS = {
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "recomputed_tokens",
    "hit_rate",
    "pages",
    "evictions",
    "requests",
    "decode_tok_s",
    "prefill_tok_s",
    "preemptions",
}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


def test_a_script_with_every_op_prints_designs_events(tmp_path) -> None:
    (tmp_path / "doc.txt").write_text("DOCUMENT")
    engine = FakeEngine(
        stall_after=lambda r: 2 if "LONG" in "".join(map(chr, r.prompt_ids)) else None
    )
    code, events, errors, engine, _ = run(
        tmp_path,
        [
            {"op": "new", "session": "a", "system": "be brief", "title": "Session A"},
            {"op": "new", "session": "b"},
            {"op": "say", "session": "a", "text": "hello", "max_tokens": 32},
            {
                "op": "say",
                "session": "b",
                "file": "doc.txt",
                "text": "summarize",
                "seed": 1,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 5,
                "min_p": 0.1,
            },
            {"op": "switch", "session": "a"},
            {"op": "wait", "session": "a"},
            {"op": "say", "session": "a", "text": "more", "ignore_eos": True, "max_tokens": 12},
            {"op": "wait"},
            {"op": "new", "session": "c"},
            {"op": "say", "session": "c", "text": "LONG story"},
            {"op": "stop", "session": "c"},
            {"op": "stats"},
        ],
        engine=engine,
        stream=True,
    )
    assert code == 0 and errors == []
    replies = [e for e in events if e["event"] == "reply"]
    assert sorted((r["session"], r["turn"]) for r in replies) == [
        ("a", 1),
        ("a", 2),
        ("b", 1),
        ("c", 1),
    ]
    for r in replies:
        assert set(r) >= REPLY_FIELDS
        assert set(r["cached_tokens"]) == {"device", "host", "disk"}
        assert r["prompt_tokens"] == sum(r["cached_tokens"].values()) + r["prefilled_tokens"]
        assert r["error"] is None
    by = {(r["session"], r["turn"]): r for r in replies}
    assert by[("a", 2)]["finish_reason"] == "length" and by[("a", 2)]["generated_tokens"] == 12
    assert by[("a", 1)]["finish_reason"] == "stop"
    assert by[("c", 1)]["finish_reason"] == "cancelled"
    assert by[("a", 2)]["cached_tokens"]["device"] > 0  # the follow-up hit the cache
    tokens = [e for e in events if e["event"] == "token" and e["session"] == "a"]
    assert "".join(t["text"] for t in tokens) == by[("a", 1)]["text"] + by[("a", 2)]["text"]
    assert all(set(t) == {"event", "session", "text", "ids"} for t in tokens)
    (stats,) = [e for e in events if e["event"] == "stats"]
    assert set(stats) >= STATS_FIELDS

    # a session's second prompt is its first prompt + reply ids + continuation
    a_requests = [r for r in engine.submitted if "be brief" in "".join(map(chr, r.prompt_ids))]
    first, second = a_requests
    reply = [ord(c) for c in by[("a", 1)]["text"]] + [END]
    continuation = CharRenderer().continuation_ids(
        [], [{"role": "user", "content": "more"}], reply_ended_with_stop=True
    )
    assert second.prompt_ids == first.prompt_ids + tuple(reply) + tuple(continuation)
    # the file's text comes first, the say's sampling keys reach the engine
    b_request = next(r for r in engine.submitted if "DOCUMENT" in "".join(map(chr, r.prompt_ids)))
    assert "DOCUMENT\n\nsummarize" in "".join(map(chr, b_request.prompt_ids))
    assert (b_request.sampling.temperature, b_request.sampling.seed) == (0.5, 1)
    assert first.sampling.greedy  # greedy by default
    assert engine.prefetched  # switch prefetched


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"op": "dance", "session": "a"}', "unknown op 'dance'"),
        ('{"op": "say", "session": "a", "text": "hi"', "not valid JSON"),
        ('{"op": "say", "session": "zz", "text": "hi"}', "unknown session 'zz'"),
        ('{"op": "say", "session": "a", "file": "nope.txt"}', "cannot read file"),
        ('{"op": "say", "session": "a", "text": "hi", "max_tokens": "9"}', "'max_tokens' must be"),
        ('{"op": "say", "session": "a", "text": 5}', "'text' must be a string"),
        (
            '{"op": "say", "session": "a", "text": "hi", "temprature": 1}',
            "unknown key 'temprature'",
        ),
        ('{"op": "say", "session": "a"}', 'needs "text" or "file"'),
        ('{"op": "new", "session": "a"}', "already exists"),
        ('["say"]', "JSON object"),
        ('{"op": []}', "unknown op '[]'"),
        ('{"op": {"say": 1}}', "unknown op"),
    ],
)
def test_a_bad_script_is_refused_with_its_line_before_anything_runs(
    tmp_path, line, message
) -> None:
    lines = [{"op": "new", "session": "a"}, {"op": "say", "session": "a", "text": "ok"}, "", line]
    code, events, errors, engine, started = run(tmp_path, lines)
    assert code == 2
    assert events == [] and not started and engine.submitted == []
    (error,) = errors
    assert error["event"] == "error" and error["line"] == 4 and message in error["message"]


def test_the_help_says_where_a_bad_scripts_error_goes() -> None:
    from kvchat.script import script_format_help

    text = " ".join(script_format_help().split())
    assert "on stdout" in text and "one error event on stderr, exit code 2" in text


def test_a_missing_script_exits_2(tmp_path) -> None:
    err = io.StringIO()
    code = run_script(
        str(tmp_path / "none.jsonl"),
        stream=False,
        save=False,
        services=lambda: pytest.fail("must not start"),
        stderr=err,
    )
    assert code == 2 and "cannot read the script" in json.loads(err.getvalue())["message"]


def test_engine_failure_mid_run_exits_1_and_prints_the_finished_replies(tmp_path) -> None:
    engine = FakeEngine(error_after_tokens=2, error_from_request=2)
    code, events, _, _, _ = run(
        tmp_path,
        [
            {"op": "new", "session": "a"},
            {"op": "say", "session": "a", "text": "one"},
            {"op": "wait"},
            {"op": "say", "session": "a", "text": "two"},
        ],
        engine=engine,
    )
    assert code == 1
    replies = [e for e in events if e["event"] == "reply"]
    assert [r["finish_reason"] for r in replies] == ["stop", "error"]
    assert replies[1]["error"] == "fake engine failure"


def test_submit_failure_is_a_reply_error_and_exit_1(tmp_path) -> None:
    code, events, _, _, _ = run(
        tmp_path,
        [{"op": "new", "session": "a"}, {"op": "say", "session": "a", "text": "x"}],
        engine=FakeEngine(fail_submit=True),
    )
    assert code == 1
    assert events[0]["finish_reason"] == "error" and "submit failed" in events[0]["error"]


def test_sessions_are_ephemeral_unless_saved(tmp_path) -> None:
    lines = [{"op": "new", "session": "a"}, {"op": "say", "session": "a", "text": "x"}]
    assert run(tmp_path, lines)[0] == 0
    assert not app_paths().database.exists()
    assert run(tmp_path, lines, save=True)[0] == 0
    from kvchat.chat.store import Store

    ((record, messages),) = Store(app_paths().database).load()
    assert record.title == "a" and [m.state for m in messages] == ["complete", "complete"]


def test_script_from_stdin_and_cli_sampling_defaults(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    engine, renderer = FakeEngine(), CharRenderer()
    out = io.StringIO()
    from kvchat.engine.request import SamplingParams

    code = run_script(
        "-",
        stream=False,
        save=False,
        services=lambda: ChatBackend(engine, renderer, renderer.stop_token_ids),
        sampling=SamplingParams(temperature=0.7, seed=3),
        max_tokens=5,
        stdin=io.StringIO('{"op":"new","session":"a"}\n{"op":"say","session":"a","text":"hi"}\n'),
        stdout=out,
    )
    engine.close()
    assert code == 0
    (request,) = engine.submitted
    assert (request.sampling.temperature, request.sampling.seed, request.max_tokens) == (0.7, 3, 5)
    assert json.loads(out.getvalue())["finish_reason"] == "length"


@pytest.mark.parametrize("body", ["", "\n\n  \n"])
def test_an_empty_script_is_refused_before_the_model_loads(tmp_path, body) -> None:
    script = tmp_path / "empty.jsonl"
    script.write_text(body)
    err = io.StringIO()
    code = run_script(
        str(script),
        stream=False,
        save=False,
        services=lambda: pytest.fail("must not start"),
        stderr=err,
    )
    error = json.loads(err.getvalue())
    assert code == 2 and error["line"] is None and "the script is empty" in error["message"]


@pytest.mark.parametrize(
    "say",
    [
        {"op": "say", "session": "a", "text": ""},
        {"op": "say", "session": "a", "text": " \n\t"},
        {"op": "say", "session": "a", "file": "blank.txt"},
        {"op": "say", "session": "a", "file": "blank.txt", "text": "  "},
    ],
)
def test_an_empty_message_is_a_script_error_with_its_line(tmp_path, say) -> None:
    (tmp_path / "blank.txt").write_text("\n   \n")
    code, events, errors, _, started = run(tmp_path, [{"op": "new", "session": "a"}, say])
    assert code == 2 and not started and events == []
    (error,) = errors
    assert error["line"] == 2 and "the message is empty" in error["message"]


def test_temperature_zero_and_an_absolute_file_path_are_valid(tmp_path) -> None:
    document = tmp_path / "elsewhere" / "doc.txt"
    document.parent.mkdir()
    document.write_text("some text")
    code, events, errors, _, started = run(
        tmp_path,
        [
            {"op": "new", "session": "a"},
            {"op": "say", "session": "a", "file": str(document), "temperature": 0},
        ],
    )
    assert code == 0 and started and errors == []
    assert [e["event"] for e in events] == ["reply"]
