"""Sessions keep their numbers, the screen explains its glyphs, meters show only this run's
figures, and a key remapped onto another action's key is refused and reported."""

from __future__ import annotations

import json
import time

from kvchat.chat.session import CachedTokens, TurnStats
from kvchat.chat.settings import Settings
from kvchat.chat.store import MessageRecord, SessionRecord, Store
from kvchat.remote.engine import RemoteStats
from kvchat.testing.tui import fake_app, new_sessions, ready, wait_until
from kvchat.tui.keys import check_keymap
from kvchat.tui.screens import HelpScreen
from kvchat.tui.sidebar import LEGEND, REMOTE_LEGEND

SIZE = (150, 45)


def row_number(app, session_id: str) -> str:
    return app.chat.sidebar.rows()[session_id].render().plain.split()[0]


async def test_a_new_session_takes_the_next_number_and_never_renumbers_the_others():
    app, _ = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        created = []
        for n in range(1, 4):
            await new_sessions(pilot, app, 1)
            await wait_until(pilot, lambda n=n: len(app.chat.sidebar.order) == n, what=f"{n} rows")
            created.append(app.chat.current)
            assert [row_number(app, s) for s in created] == [str(i) for i in range(1, n + 1)]
        await pilot.press("alt+1")
        assert app.chat.current == created[0]
        await pilot.press("alt+3")
        assert app.chat.current == created[2]


async def test_archiving_or_deleting_a_session_never_renumbers_the_others(tmp_path):
    """Four sessions; the second archived and the third deleted: alt+4 still opens the
    fourth, the next new session takes the lowest free number, and a restart keeps them."""
    path = tmp_path / "sessions.db"
    app, _ = fake_app(store=Store(path))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        created = []
        for n in range(1, 5):
            await new_sessions(pilot, app, 1)
            await wait_until(pilot, lambda n=n: len(app.chat.sidebar.order) == n, what=f"{n} rows")
            created.append(app.chat.current)
        for key, gone in (("f6", created[1]), ("f8", created[2])):
            await pilot.press("alt+" + str(created.index(gone) + 1))
            assert app.chat.current == gone
            await pilot.press(key)
            await wait_until(pilot, lambda g=gone: g not in app.chat.sidebar.order, what="it left")
        shown = {s: row_number(app, s) for s in app.chat.sidebar.order}
        assert shown == {created[0]: "1", created[3]: "4"}
        await pilot.press("alt+4")
        assert app.chat.current == created[3]
        await new_sessions(pilot, app, 1)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 3, what="a new row")
        newest = app.chat.current
        assert row_number(app, newest) == "2"  # the lowest number no listed session holds
        await pilot.press("alt+1")
        assert app.chat.current == created[0]
    again, _ = fake_app(store=Store(path))
    async with again.run_test(size=SIZE) as pilot:
        await ready(pilot, again)
        shown = {s: row_number(again, s) for s in again.chat.sidebar.order}
        assert shown == {created[0]: "1", newest: "2", created[3]: "4"}
        await pilot.press("alt+4")
        assert again.chat.current == created[3]


def test_a_misspelled_key_name_is_refused_naming_the_setting_and_line(tmp_path):
    from kvchat.chat.settings import parse_settings_checked

    text = '[keys]\nquit = "ctrl+q"\nnext_session = "ctrl+rigth"\nnew_session = "ctlr+n"\n'
    settings, problems = parse_settings_checked(text, tmp_path / "settings.toml")
    assert problems == ()  # strings, as the file format asks: the key names are the UI's
    keymap, key_problems = check_keymap(settings.keys, settings.sources)
    assert keymap == {"quit": "ctrl+q"}  # the two bad ones keep their default keys
    rigth, ctlr = key_problems
    assert "settings.toml, line 3" in rigth and "'rigth' is no key name" in rigth
    assert "next_session keeps ctrl+pagedown" in rigth
    assert "line 4" in ctlr and "'ctlr' is not a modifier" in ctlr


async def test_the_sidebar_has_a_legend_and_help_explains_every_glyph_and_figure():
    app, _ = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert app.chat.sidebar.border_subtitle == LEGEND
        for glyph in "█▓▒░":
            assert glyph in LEGEND
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        text = "\n".join(str(s.render()) for s in app.screen.query("Static"))
        for words in (
            "█ on the compute device",
            "▓ in the host tier",
            "▒ only on disk",
            "░ in no tier",
            "last hit N%",
            "ctx N%",
            "● unread",
            "■ active",
            "□ cached",
            "· free",
            "active/cached/free",
            "Hit rate",
            "Evictions",
            "TTFT",
            "all: tokens a second",
            "this reply: the shown session",
            "previous turn",
            "—",
        ):
            assert words in text, words
        # a glyph means one thing: the sidebar's tier blocks appear nowhere in the meters
        await pilot.press("escape")
        meters_text = " ".join(str(label.render()) for label in app.chat.meters.query("Label"))
        meters_text += " ".join(app.chat.meters.values.values())
        assert "active" in meters_text and not set("█▓▒░") & set(meters_text), meters_text


def stored_session_with_a_finished_turn(path) -> None:
    store = Store(path)
    now = time.time() - 3600
    stats = TurnStats("stop", 40, CachedTokens(30, 0, 0), 10, 0, 5, 0.25, 27.0)
    store.save(
        SessionRecord("s1", "earlier", now, now, False, None, "fake-model", b"", True, None, None),
        [
            MessageRecord("m1", 0, "user", "hi", "complete", None, 0, False, True, None, now),
            MessageRecord(
                "m2",
                1,
                "assistant",
                "hello",
                "complete",
                json.dumps(stats.to_json()),
                None,
                False,
                True,
                None,
                now,
            ),
        ],
    )
    store.close()


async def test_meters_show_no_figures_of_a_turn_from_before_this_start(tmp_path):
    stored_session_with_a_finished_turn(tmp_path / "db.sqlite3")
    app, engine = fake_app(store=Store(tmp_path / "db.sqlite3"), manual=True, tokens_per_reply=8)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        await wait_until(pilot, lambda: app.chat.current == "s1", what="the stored session")
        await wait_until(pilot, lambda: "decode" in app.chat.meters.values, what="meters")
        values = app.chat.meters.values
        assert values["hit-rate"].startswith("last turn —")
        assert values["ttft"] == "—"
        assert values["decode"] == "last turn —   all —", values["decode"]

        # a new turn: while it streams, "this" is never "—"; once done, its figures show
        await pilot.press(*"again")
        await pilot.press("enter")
        seen: list[str] = []
        hit_rates: list[str] = []
        await wait_until(pilot, lambda: app.service.session("s1").state != "idle", what="sent")
        for _ in range(12):
            engine.advance(1)
            await pilot.pause()
            app.chat.frames.tick_meters()
            if app.service.session("s1").state != "idle":
                seen.append(app.chat.meters.values["decode"])
                hit_rates.append(app.chat.meters.values["hit-rate"])
        await wait_until(pilot, lambda: app.service.session("s1").state == "idle", what="done")
        await wait_until(
            pilot, lambda: app.chat.meters.values["ttft"] != "—", what="this turn's TTFT"
        )
        assert seen and all(v.startswith("this reply ") for v in seen), seen
        assert all(not v.startswith("this reply —") for v in seen), seen
        # while the reply is on the way, the turn figures say they are of the turn before
        assert hit_rates and all(v.startswith("previous turn") for v in hit_rates), hit_rates
        assert app.chat.meters.values["hit-rate"].startswith("last turn ")
        assert not app.chat.meters.values["hit-rate"].startswith("last turn —")
        assert app.chat.meters.values["ttft"].startswith("last turn ")


async def test_a_key_remapped_onto_another_actions_key_is_refused_and_reported():
    app, _ = fake_app(settings=Settings(keys={"quit": "ctrl+n"}))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        texts = [n.message for n in app._notifications]
        assert any("quit" in t and "ctrl+n" in t and "new_session" in t for t in texts), texts
        await pilot.press("ctrl+n")  # still a new session, not quit
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 1, what="a new session")
        assert app.is_running


def test_check_keymap_refuses_clashes_and_accepts_swaps():
    keymap, problems = check_keymap({"help": "f2"})
    assert keymap == {} and "f2 is already the key of rename" in problems[0]
    keymap, problems = check_keymap({"stop": "enter"})
    assert keymap == {} and "send" in problems[0]
    keymap, problems = check_keymap({"quit": "ctrl+x", "new_session": "ctrl+q"})
    assert keymap == {"quit": "ctrl+x", "new_session": "ctrl+q"} and problems == []


async def test_with_a_remote_server_the_sidebar_legend_says_what_its_rows_show():
    """A server cannot say where a session's history lives: no residency glyphs to explain."""
    app, engine = fake_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot, app)
        assert app.chat.sidebar.border_subtitle == LEGEND
        remote = RemoteStats(engine={"kind": "vllm", "url": "http://127.0.0.1:1", "model": "m"})
        engine.stats = lambda: remote
        await wait_until(
            pilot, lambda: app.chat.sidebar.border_subtitle == REMOTE_LEGEND, what="remote legend"
        )


async def test_a_long_title_keeps_every_row_three_lines_current_or_not():
    app, _ = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot, app)
        await new_sessions(pilot, app, 2)
        await wait_until(pilot, lambda: len(app.chat.sidebar.order) == 2, what="two rows")
        first, second = app.chat.sidebar.order
        app.service.rename(first, "a title long enough to wrap in the sidebar")
        app.service.rename(second, "another title long enough to wrap there")
        await app.chat.refresh_sessions()
        for target in (first, second, first):
            await pilot.press(f"alt+{app.chat.views[target].number}")
            await wait_until(pilot, lambda t=target: app.chat.current == t, what="switched")
            await pilot.pause()
            heights = [row.size.height for row in app.chat.sidebar.rows().values()]
            assert heights == [3, 3], heights
