"""The TUI's pure parts: the stream buffer's offsets, keymap checks, sampling text, attachments."""

from __future__ import annotations

import pytest

from kvchat.chat.attachments import attachment_text
from kvchat.chat.sampling_text import parse_sampling, sampling_text
from kvchat.engine.request import SamplingParams
from kvchat.errors import KvchatError
from kvchat.tui.keys import BINDING_IDS, check_keymap
from kvchat.tui.stream_buffer import StreamBuffer
from tests.tui_helpers import session_view


def test_stream_buffer_keeps_offsets_and_drops_hidden_sessions_text():
    buf = StreamBuffer()
    buf.add("a", "m1", "hel", 1)
    buf.add("b", "m2", "xyz", 1)
    buf.add("a", "m1", "lo", 1)
    [chunk] = buf.take("a")
    assert (chunk.message_id, chunk.start, chunk.text) == ("m1", 0, "hello")
    assert buf.take("b") == []  # dropped when "a" was taken: a switch re-reads the service
    buf.add("b", "m2", "!", 1)
    [chunk] = buf.take("b")
    assert (chunk.start, chunk.text) == (3, "!")  # offsets count dropped text too


def test_keymap_keeps_known_ids_and_reports_unknown_ones():
    keymap, problems = check_keymap({"next_session": "ctrl+right, alt+j", "nope": "x"})
    assert keymap == {"next_session": "ctrl+right,alt+j"}
    assert len(problems) == 1 and "nope" in problems[0]
    assert {"send", "newline", "quit", "stop", "jump_1", "command_palette"} <= BINDING_IDS


def test_sampling_text_round_trips_and_bad_values_are_errors():
    base = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    text = sampling_text(base, 256)
    assert parse_sampling(text, SamplingParams(), 1) == (base, 256)
    assert parse_sampling("temperature=0", base, 9)[0].temperature == 0.0
    for bad in ("temperature=hot", "warmth=1", "top_p=2", "max_tokens=0", "temperature"):
        with pytest.raises(KvchatError):
            parse_sampling(bad, base, 9)


def test_attachment_is_fenced_text_and_binary_files_are_refused(tmp_path):
    doc = tmp_path / "code.py"
    doc.write_text("x = '```'\n", encoding="utf-8")
    block = attachment_text(doc)
    assert "code.py" in block and "x = '```'" in block
    assert "\n````\n" in block  # a fence longer than any run of backticks inside
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(KvchatError, match="not a UTF-8 text file"):
        attachment_text(blob)
    with pytest.raises(KvchatError, match="cannot read"):
        attachment_text(tmp_path / "missing.txt")


def test_each_service_event_kind_becomes_the_message_for_its_effect_and_text_is_buffered():
    import typing

    from kvchat.chat import events as ev
    from kvchat.chat.session import SessionSnapshot, TurnState
    from kvchat.tui import messages as ui
    from kvchat.tui.service_events import relay_to

    view = session_view(id="s", title="t", state=TurnState.IDLE, message_count=0,
                        context_tokens=0)  # fmt: skip
    snap = SessionSnapshot(view, ())
    samples = {
        ev.SessionCreated: (ev.SessionCreated("s"), ui.RelistSessions),
        ev.SessionArchived: (ev.SessionArchived("s", True), ui.RelistSessions),
        ev.SessionDeleted: (ev.SessionDeleted("s", True), ui.RelistSessions),
        ev.SessionRenamed: (ev.SessionRenamed("s", "t", snap), ui.RedrawSession),
        ev.SessionChanged: (ev.SessionChanged("s", snap), ui.RedrawSession),
        ev.ReplyStarted: (ev.ReplyStarted("s", "m", 1, snap), ui.RedrawSession),
        ev.ReplyFinished: (ev.ReplyFinished("s", "m", 1, "hi", None, snap), ui.FinishReply),
        ev.SessionNotice: (ev.SessionNotice("s", "note", snap), ui.ShowSessionNotice),
        ev.SessionFailed: (ev.SessionFailed("s", "no room", snap), ui.ReportSessionFailure),
        ev.TypeAheadChanged: (ev.TypeAheadChanged("s", 1200, 1500), ui.ShowTokensReady),
        ev.SaveFailed: (ev.SaveFailed("disk full", 3), ui.ShowSaveFailure),
        ev.SaveRecovered: (ev.SaveRecovered(), ui.ClearSaveFailure),
    }
    assert set(samples) | {ev.ReplyDelta} == set(typing.get_args(ev.ChatEvent))
    buffer, posted = StreamBuffer(), []
    relay = relay_to(buffer, posted.append)
    for event, message_type in samples.values():
        relay(event)
        assert type(posted[-1]) is message_type, type(event).__name__
    assert posted[[type(m) for m in posted].index(ui.ShowTokensReady)].label == "1,200 tokens ready"
    count = len(posted)
    relay(ev.ReplyDelta("s", "m", "hello", (1, 2)))
    assert len(posted) == count  # reply text is never a message: the frame pump shows it
    [chunk] = buffer.take("s")
    assert chunk.text == "hello"
