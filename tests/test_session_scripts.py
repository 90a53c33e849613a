"""Switching sessions on the real model: four sessions with long documents and
interleaved follow-ups prefill only each new turn (+1 token) and answer exactly as the
same session run alone (float32, greedy)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.model.loader import load_model
from tests.engine_helpers import small_engine

DOCS = ["inspect", "typing", "argparse", "dataclasses"]
FOLLOW_UPS = ["Name one function defined in that code.", "Is there any error handling in it?"]


def document(name: str, model, tokens: int = 500) -> str:
    module = __import__(name)
    ids = model.tokenizer.encode(Path(inspect.getfile(module)).read_text())[:tokens]
    return "```python\n" + model.tokenizer.decode(ids) + "\n```\n\nSummarize the code above."


def run_sessions(model, names: list[str]) -> tuple[dict[str, list], dict[str, list[int]]]:
    """Round-robin turns over `names`' sessions; replies and per-turn prefill counts."""
    with small_engine(model, page_size=64, device_cache_bytes=256 << 20) as engine:
        service = SessionService(
            engine, model.renderer, Store.in_memory(), stop_token_ids=model.tokenizer.stop_token_ids
        )
        finished: list = []
        service.subscribe(
            lambda e: finished.append(e) if type(e).__name__ == "ReplyFinished" else None
        )
        ids = {n: service.create_session(n) for n in names}
        before: dict[str, list[int]] = {n: [] for n in names}
        for turn in range(1 + len(FOLLOW_UPS)):
            for n in names:
                before[n].append(len(service.token_ids(ids[n])))
                text = document(n, model) if turn == 0 else FOLLOW_UPS[turn - 1]
                service.say(ids[n], text, max_tokens=16)
                assert service.wait_idle(ids[n], timeout=300)
        service.close()
    by_session = {n: [e for e in finished if e.session_id == ids[n]] for n in names}
    return by_session, before


@pytest.mark.real_model
@pytest.mark.slow
def test_four_interleaved_sessions_prefill_only_new_turns_and_match_solo_runs(default_gguf_path):
    model = load_model(str(default_gguf_path), dtype="float32", device="cpu")
    together, before = run_sessions(model, DOCS)
    for name in DOCS:
        replies = together[name]
        for turn, reply in enumerate(replies[1:], start=1):
            new_tokens = reply.stats.prompt_tokens - before[name][turn]
            assert reply.stats.prefilled_tokens <= new_tokens + 1
        alone, _ = run_sessions(model, [name])
        assert [r.text for r in replies] == [r.text for r in alone[name]]
