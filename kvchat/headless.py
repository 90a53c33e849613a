"""`kvchat run SCRIPT`: the sessions and the engine with no UI, driven by a JSON Lines script.

Wiring only: the script is parsed and validated whole (`kvchat/script.py`)
before the model is even loaded, then each op becomes a `SessionService` call
and each service event a JSON line (docs/architecture.md, "Headless events"). `say`
never waits, so replies of different sessions run concurrently as in the TUI; nor
does `draft` (the user's next message computed ahead while `pause` lets time
pass, as while a person types); the script's end waits for every reply. Exit
codes: 0 ok, 1 a reply, the engine or a save failed (every finished reply is
still printed; with `--save`, a failed write is an `error` event at once, and
what could not be stored is written to a recovery file named by a last `error`
event), 2 a bad script or option.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.error_log import log_exception
from kvchat.chat.events import (
    ChatEvent,
    ReplyDelta,
    ReplyFinished,
    SaveFailed,
    SessionFailed,
)
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.api import FinishReason, SamplingParams
from kvchat.errors import KvchatError, UsageError
from kvchat.paths import app_paths
from kvchat.script import (
    NewOp,
    Op,
    PauseOp,
    SayOp,
    ScriptError,
    StatsOp,
    StopOp,
    SwitchOp,
    TypeAheadOp,
    WaitOp,
    parse_script,
)

EXIT_OK, EXIT_FAILED, EXIT_BAD_SCRIPT = 0, 1, 2
EXIT_BAD_INPUT = EXIT_BAD_SCRIPT  # bad options too: the same status as a bad script


class _Printer:
    """One JSON object a line; a lock because events come from the service's worker thread."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()

    def emit(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, ensure_ascii=False)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


def read_script(path_or_dash: str, stdin: TextIO | None = None) -> list[Op]:
    """Parse a script file (or stdin for "-"); ScriptError when it is bad or unreadable."""
    if path_or_dash == "-":
        text, base_dir = (stdin or sys.stdin).read(), Path.cwd()
    else:
        path = Path(path_or_dash).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ScriptError(f"cannot read the script {str(path)!r}: {reason}", None) from None
        base_dir = path.resolve().parent
    return parse_script(text, base_dir)


def reply_event(session: str, event: ReplyFinished) -> dict[str, Any]:
    """The headless `reply` event, plus `hit_rate` and `draft_tokens` (the type-aheads' tokens
    it used)."""
    stats = event.stats
    return {
        "event": "reply",
        "session": session,
        "turn": event.turn,
        "text": event.text,
        "finish_reason": stats.finish_reason,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": {
            "device": stats.cached_tokens.device,
            "host": stats.cached_tokens.host,
            "disk": stats.cached_tokens.disk,
        },
        "prefilled_tokens": stats.prefilled_tokens,
        "recomputed_tokens": stats.recomputed_tokens,
        "generated_tokens": stats.generated_tokens,
        "ttft_s": stats.ttft_s,
        "decode_tok_s": stats.decode_tok_s,
        "hit_rate": stats.hit_rate,
        "draft_tokens": stats.draft_tokens,
        "error": stats.error if stats.finish_reason == FinishReason.ERROR else None,
    }


def run_script(
    path_or_dash: str,
    *,
    stream: bool,
    save: bool,
    services: Callable[[], ChatBackend],
    sampling: SamplingParams | None = None,
    max_tokens: int = 512,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run a headless script; returns the exit code (0, 1 or 2). Never raises for user errors.

    `services` is called only after the script validated (loading a model is slow).
    `sampling` is the command line's defaults (greedy when None); a `say` overrides
    its keys. `save=True` keeps the sessions in the database the TUI shows.
    """
    out = _Printer(stdout or sys.stdout)
    try:
        ops = read_script(path_or_dash, stdin)
    except ScriptError as exc:
        _Printer(stderr or sys.stderr).emit(
            {"event": "error", "message": exc.message, "line": exc.line}
        )
        return EXIT_BAD_SCRIPT
    try:
        backend = services()
        store = Store(app_paths().database) if save else Store.in_memory()
    except UsageError as exc:  # e.g. a cache size larger than the machine's memory
        out.emit({"event": "error", "message": str(exc), "line": None})
        return EXIT_BAD_INPUT
    except KvchatError as exc:
        out.emit({"event": "error", "message": str(exc), "line": None})
        return EXIT_FAILED
    except Exception as exc:
        log_exception("headless: starting the engine failed")
        out.emit({"event": "error", "message": f"the engine failed to start: {exc}", "line": None})
        return EXIT_FAILED
    service = SessionService(
        backend.engine,
        backend.renderer,
        store,
        stop_token_ids=backend.stop_token_ids,
        default_sampling=sampling or SamplingParams(),
        default_max_tokens=max_tokens,
    )
    runner = _Runner(service, out, stream)
    try:
        code = runner.run(ops)
    finally:  # also when interrupted: the path of what could not be saved is printed
        unsaved = service.close()
        if unsaved is not None:
            out.emit(
                {
                    "event": "error",
                    "message": unsaved.summary(),
                    "line": None,
                    "recovery_file": str(unsaved.path) if unsaved.path else None,
                }
            )
            if unsaved.path is None:
                (stderr or sys.stderr).write(unsaved.text)
    return EXIT_FAILED if unsaved is not None else code


class _Runner:
    def __init__(self, service: SessionService, out: _Printer, stream: bool) -> None:
        self.service = service
        self.out = out
        self.stream = stream
        self.ids: dict[str, str] = {}  # script name -> session id
        self.names: dict[str, str] = {}  # session id -> script name
        self.failed = False
        # a turn's number -> its script line: a say refused as it was sent names its line
        self.lines: dict[int, int] = {}
        self._lines_lock = threading.Lock()  # a refusal may be published before `say` returns
        # False for a backend that streams text without ids (a remote server)
        self.token_ids = getattr(service.engine, "streams_token_ids", True)
        service.subscribe(self.on_event)

    def on_event(self, event: ChatEvent) -> None:
        name = self.names.get(getattr(event, "session_id", ""), "")
        if isinstance(event, ReplyFinished):
            if event.stats.finish_reason == FinishReason.ERROR:
                self.failed = True
            self.out.emit(reply_event(name, event))
        elif isinstance(event, ReplyDelta) and self.stream:
            self.out.emit(
                {
                    "event": "token",
                    "session": name,
                    "text": event.text,
                    # a remote server sends text only: its ids are unknown, not empty
                    "ids": list(event.token_ids) if self.token_ids else None,
                }
            )
        elif isinstance(event, SessionFailed):
            self.failed = True
            with self._lines_lock:
                line = None if event.waited else self.lines.get(event.turn)
            self.out.emit({"event": "error", "message": event.message, "line": line})
        elif isinstance(event, SaveFailed):
            self.failed = True
            self.out.emit(
                {
                    "event": "error",
                    "message": f"could not save to the session database: {event.error}; "
                    f"{event.unsaved_messages} messages wait, retrying",
                    "line": None,
                }
            )

    def run(self, ops: list[Op]) -> int:
        for op in ops:
            try:
                self.apply(op)
            except KvchatError as exc:  # e.g. a prompt that does not fit the context
                self.failed = True
                self.out.emit({"event": "error", "message": str(exc), "line": op.line})
            except Exception as exc:  # the engine broke: stop here, report what finished
                log_exception(f"headless: line {op.line} failed")
                self.failed = True
                self.out.emit(
                    {"event": "error", "message": f"engine failure: {exc}", "line": op.line}
                )
                break
        self.service.wait_idle()
        self.service.flush()
        return EXIT_FAILED if self.failed else EXIT_OK

    def apply(self, op: Op) -> None:
        service = self.service
        if isinstance(op, NewOp):
            session_id = service.create_session(op.title or op.session, system=op.system)
            self.ids[op.session] = session_id
            self.names[session_id] = op.session
        elif isinstance(op, SayOp):
            session_id = self.ids[op.session]
            overrides = {
                k: getattr(op, k)
                for k in ("temperature", "top_p", "top_k", "min_p", "seed")
                if getattr(op, k) is not None
            }
            base = service.session(session_id).sampling
            with self._lines_lock:
                turn = service.say(
                    session_id,
                    op.text,
                    sampling=replace(base, **overrides) if overrides else None,
                    max_tokens=op.max_tokens,
                    ignore_eos=op.ignore_eos,
                )
                self.lines[turn] = op.line
            # a script's ops run in order: the next one finds this turn started (or refused)
            service.flush()
        elif isinstance(op, TypeAheadOp):
            service.type_ahead(self.ids[op.session], op.text)
        elif isinstance(op, PauseOp):
            time.sleep(op.seconds)
        elif isinstance(op, WaitOp):
            service.wait_idle(self.ids[op.session] if op.session else None)
        elif isinstance(op, StopOp):
            service.stop(self.ids[op.session])
        elif isinstance(op, SwitchOp):
            service.focus(self.ids[op.session])
        elif isinstance(op, StatsOp):
            self.out.emit({"event": "stats", **service.engine.stats().to_json()})


def main(args) -> int:
    """`kvchat run SCRIPT`: the command line's options, then `run_script`."""
    from kvchat.remote.options import remote_options
    from kvchat.runtime import greedy_sampling, open_chat_backend, read_settings, resolve_options

    settings = read_settings()
    options = resolve_options(args, settings)
    remote = remote_options(args, settings)
    opened: list = []

    def progress(message: str) -> None:
        print(message, file=sys.stderr)

    def services() -> ChatBackend:
        backend = open_chat_backend(options, settings, progress, greedy=True, remote=remote)
        opened.append(backend)
        progress(backend.describe())  # the cache tiers' sizes (the disk tier's default too)
        return backend.chat

    try:
        return run_script(
            args.script,
            stream=args.stream,
            save=args.save,
            services=services,
            sampling=greedy_sampling(options),  # known before the model loads
            max_tokens=args.max_tokens or 512,
        )
    finally:
        for backend in opened:
            backend.close()
