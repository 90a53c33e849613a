"""Running a headless script over the fake engine, for the headless tests."""

from __future__ import annotations

import io
import json
from pathlib import Path

from kvchat.chat.engine_port import ChatBackend
from kvchat.headless import run_script
from kvchat.testing.fake_engine import CharRenderer, FakeEngine


def run(tmp_path: Path, lines: list[dict | str], engine: FakeEngine | None = None, **kw):
    script = tmp_path / "script.jsonl"
    script.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    engine = engine or FakeEngine()
    renderer = CharRenderer()
    calls = []

    def services() -> ChatBackend:
        calls.append(1)
        return ChatBackend(engine, renderer, renderer.stop_token_ids)

    out, err = io.StringIO(), io.StringIO()
    try:
        code = run_script(
            str(script),
            stream=kw.pop("stream", False),
            save=kw.pop("save", False),
            services=services,
            stdout=out,
            stderr=err,
            **kw,
        )
    finally:
        engine.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    errors = [json.loads(line) for line in err.getvalue().splitlines()]
    return code, events, errors, engine, bool(calls)
