"""kill -9 at random moments: the database stays sound and nothing acknowledged is lost.

Two halves over one data folder, on the tiny random model: `kvchat run --save`
killed at random moments (during start-up, mid-stream, just after a reply was
printed), and the TUI in a real terminal (tmux) killed while a scripted user
types and replies stream. After each kill, `PRAGMA integrity_check` must say ok
and every message that was acknowledged is in the database: a `reply` event
printed by `run` (its text, complete, after its own message), a turn the TUI
showed as finished (the message, then a complete reply).

`KVCHAT_KILLS` sets how many kills (default 30: two thirds `run`, a third the TUI);
`KVCHAT_KILL_SEED` the random seed (default: a new one, printed on failure).
Figures: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
KILLS = int(os.environ.get("KVCHAT_KILLS", "30"))
MODEL_FLAGS = [
    "--dtype", "float32", "--device-cache", "16MiB", "--host-cache", "16MiB",
    "--page-size", "16",
]  # fmt: skip


@pytest.fixture
def kill_home(tmp_path, native_kernels) -> Path:
    """A data folder shared by every kill; the kernels already built (no compile to kill)."""
    home = tmp_path / "home"
    (home / "cache").mkdir(parents=True)  # the kernels: the run's shared build
    return home


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("KVCHAT_KILL_SEED", str(random.randrange(1 << 30))))
    print(f"kill loop seed: {seed} (KVCHAT_KILL_SEED)")
    return random.Random(seed)


def database(home: Path) -> Path:
    return home / "data" / "sessions.sqlite3"


def stored_sessions(home: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Title -> (role, state, content) in order; integrity checked first, read-only."""
    path = database(home)
    if not path.exists():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        out: dict[str, list[tuple[str, str, str]]] = {}
        for sid, title in db.execute("SELECT id, title FROM sessions"):
            out[title] = [
                (role, state, content)
                for role, state, content in db.execute(
                    "SELECT role, state, content FROM messages WHERE session_id = ? ORDER BY seq",
                    (sid,),
                )
            ]
        return out
    finally:
        db.close()


# ---------------------------------------------------------------- kvchat run --save


def run_script(iteration: int) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """Two sessions replying at once, three turns each; returns the script and
    name -> (title, the texts said in order)."""
    sessions = {name: (f"run{iteration}-{name}", []) for name in ("a", "b")}
    lines = [json.dumps({"op": "new", "session": n, "title": t}) for n, (t, _) in sessions.items()]
    for turn in range(3):
        for name, (_, said) in sessions.items():
            text = f"run {iteration} {name} turn {turn}"
            said.append(text)
            lines.append(
                json.dumps(
                    {
                        "op": "say",
                        "session": name,
                        "text": text,
                        "max_tokens": 24,
                        "ignore_eos": True,
                    }
                )
            )
    return "\n".join(lines) + "\n", sessions


def kill_run_once(home: Path, model: Path, tmp: Path, iteration: int, rng: random.Random) -> int:
    """Start `kvchat run --save`, kill it at a random moment, check the database; returns
    how many replies it had printed."""
    script_text, sessions = run_script(iteration)
    script = tmp / f"run{iteration}.jsonl"
    script.write_text(script_text)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchat", "run", str(script), "--save", "--model", str(model),
         *MODEL_FLAGS],
        cwd=ROOT,
        env={**os.environ, "KVCHAT_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    replies: list[dict] = []
    seen = threading.Condition()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = json.loads(line)
            with seen:
                if event["event"] == "reply":
                    replies.append(event)
                seen.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # the moment: after 0-4 printed replies, then a random fraction of a second (with
    # none printed yet, anywhere in start-up)
    after = rng.randrange(5)
    with seen:
        seen.wait_for(lambda: len(replies) >= after or proc.poll() is not None, timeout=120)
    time.sleep(rng.uniform(0, 4.0) if after == 0 else rng.uniform(0, 0.4))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    with seen:
        acknowledged = list(replies)

    stored = stored_sessions(home)
    for reply in acknowledged:
        title, said = sessions[reply["session"]]
        messages = stored[title]
        users = [i for i, m in enumerate(messages) if m[0] == "user"]
        at = users[reply["turn"] - 1]
        assert messages[at] == ("user", "complete", said[reply["turn"] - 1])
        assert messages[at + 1] == ("assistant", "complete", reply["text"]), (
            f"run {iteration}: the printed reply of {title} turn {reply['turn']} is not stored"
        )
    return len(acknowledged)


# ------------------------------------------------------------------------ the TUI


def turn_shown_finished(screen: str, text: str) -> bool:
    """The message is in the transcript, a reply follows it, and nothing is being written."""
    lines = screen.splitlines()
    at = [i for i, line in enumerate(lines) if f"│ {text} " in line]
    return (
        bool(at)
        and any("Assistant" in line for line in lines[at[-1] :])
        and "writing…" not in screen
        and " idle " in screen
    )


def kill_tui_once(
    home: Path, model: Path, iteration: int, rng: random.Random, terminals
) -> list[str]:
    """Open the TUI, send 0-2 finished turns and start one more, kill at a random moment;
    returns the messages whose turn the screen showed finished."""
    from tests.tmux_helpers import ready

    term = terminals(home, model, "--max-tokens", "40")
    acknowledged: list[str] = []
    if rng.random() < 0.15:  # sometimes during start-up
        time.sleep(rng.uniform(0, 3.0))
    else:
        ready(term)
        for turn in range(rng.randrange(3)):
            text = f"tui {iteration} turn {turn}"
            term.type(text)
            # a turn stored but not drawn finished (e.g. left below the view) fails the run
            term.wait(lambda s, t=text: turn_shown_finished(s, t), f"{text!r} finished", 180)
            acknowledged.append(text)
        term.type(f"tui {iteration} cut")
        time.sleep(rng.uniform(0, 1.5))
    try:
        pid = term.kvchat_pid()
    except AssertionError:
        pid = None  # not started yet, or already gone
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        term.wait_text("KVCHAT-EXITED-137", 30)

    stored = stored_sessions(home)
    messages = [m for session in stored.values() for m in session]
    for text in acknowledged:
        at = messages.index(("user", "complete", text))
        role, state, _ = messages[at + 1]
        assert (role, state) == ("assistant", "complete"), (
            f"TUI {iteration}: the finished turn {text!r} is not stored whole"
        )
    return acknowledged


# ------------------------------------------------------------------------ the loops

TUI_KILLS = KILLS // 3
RUN_KILLS = KILLS - TUI_KILLS


def test_kill_9_of_kvchat_run_keeps_the_database_sound_and_every_printed_reply(
    tmp_path, tiny_llama_dir, kill_home, rng
) -> None:
    printed = sum(
        kill_run_once(kill_home, tiny_llama_dir, tmp_path, i, rng) for i in range(RUN_KILLS)
    )
    print(f"kill -9 of kvchat run --save: {RUN_KILLS} kills, {printed} printed replies checked")
    assert printed > 0  # some moments came after replies, not all in start-up


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="the TUI half needs a terminal: tmux is not installed"
)
def test_kill_9_of_the_tui_keeps_the_database_sound_and_every_finished_turn(
    tiny_llama_dir, kill_home, rng
) -> None:
    from tests.tmux_helpers import Terminal

    opened: list[Terminal] = []

    def terminals(home: Path, model: Path, *extra: str) -> Terminal:
        opened.append(Terminal(home, model, *extra))
        return opened[-1]

    try:
        shown = sum(
            len(kill_tui_once(kill_home, tiny_llama_dir, i, rng, terminals))
            for i in range(TUI_KILLS)
        )
    finally:
        for terminal in opened:
            terminal.close()
    print(f"kill -9 of the TUI: {TUI_KILLS} kills, {shown} finished turns checked")
    assert shown > 0
