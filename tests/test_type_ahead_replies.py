"""Nothing a type-ahead held changes the answer: the real model in float32, greedy.

Each conversation runs on a fresh engine (nothing cached) with and without type-aheads
of every kind: extended as typed, edited in the middle, shortened, replaced by
other text, cancelled part way, evicted before the turn, ending inside a word and
across page boundaries (16-token pages). The stored ids (prompt and reply) must
be identical, and a type-ahead that survived must have served part of the prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvchat.chat.events import ReplyFinished
from kvchat.chat.service import SessionService
from kvchat.chat.session import TurnStats
from kvchat.chat.store import Store
from kvchat.engine.request import SamplingParams
from kvchat.model.loader import load_model
from tests.engine_helpers import small_engine

pytestmark = pytest.mark.real_model

DOC = (
    "```python\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef spread(values):\n    return max(values) - "
    "min(values)\n```"
)
EDITED = DOC.replace("total += v", "total = total + v")
QUESTION = "What does the function mean return?"
FOLLOW_UP = "Name the other function."
TEXT = f"{DOC}\n\n{QUESTION}"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smollm_fp32(default_gguf_path):
    return load_model(str(default_gguf_path), dtype="float32", device="cpu")


class Chat:
    """One session over a fresh engine; `say` waits for the reply and returns its stats."""

    def __init__(self, model, **engine_kw) -> None:
        self.engine = small_engine(model, page_size=16, **engine_kw)
        self.service = SessionService(
            self.engine,
            model.renderer,
            Store.in_memory(),
            stop_token_ids=model.tokenizer.stop_token_ids,
            default_sampling=SamplingParams(temperature=0.0),
            default_max_tokens=MAX_TOKENS,
        )
        self.finished: list[ReplyFinished] = []
        self.service.subscribe(
            lambda e: self.finished.append(e) if isinstance(e, ReplyFinished) else None
        )
        self.sid = self.service.create_session("t")

    def type_ahead(self, text: str, *, wait: bool = True) -> None:
        self.service.type_ahead(self.sid, text)
        while wait:
            self.service.flush(5)
            ready, total = self.service.type_ahead_progress(self.sid)
            if total and ready == total:
                return
            threading.Event().wait(0.02)

    def say(self, text: str, sid: str | None = None) -> TurnStats:
        self.service.say(sid or self.sid, text)
        assert self.service.wait_idle(sid or self.sid, timeout=300)
        self.service.flush(5)
        return self.finished[-1].stats

    def ids(self) -> tuple[int, ...]:
        return self.service.token_ids(self.sid)

    def close(self) -> None:
        self.engine.validate_cache()
        self.service.close()
        self.engine.close()


def run(model, before: Callable[[Chat], None], text: str = TEXT, **engine_kw):
    chat = Chat(model, **engine_kw)
    try:
        before(chat)
        stats = chat.say(text)
        return chat.ids(), stats
    finally:
        chat.close()


@pytest.fixture(scope="module")
def plain(smollm_fp32) -> dict[str, tuple[int, ...]]:
    """Each text's ids after its turn with no type-ahead at all."""
    out = {}
    for text in (TEXT, f"{EDITED}\n\n{QUESTION}"):
        ids, stats = run(smollm_fp32, lambda _c: None, text)
        assert stats.draft_tokens == 0 and stats.generated_tokens > 0
        out[text] = ids
    return out


def test_a_type_ahead_gives_the_same_reply_and_serves_the_prompt(smollm_fp32, plain):
    ids, stats = run(smollm_fp32, lambda c: c.type_ahead(f"{DOC}\n\nWhat does the func"))
    assert ids == plain[TEXT]
    # the type-ahead ends inside a word ("func"): everything before it was served
    assert stats.draft_tokens >= stats.prompt_tokens - 16
    assert stats.draft_tokens <= stats.cached_tokens.device


def test_a_type_ahead_edited_in_the_middle_gives_the_same_reply(smollm_fp32, plain):
    text = f"{EDITED}\n\n{QUESTION}"
    ids, stats = run(smollm_fp32, lambda c: c.type_ahead(TEXT), text)
    assert ids == plain[text]
    assert 0 < stats.draft_tokens < stats.prompt_tokens // 2  # only what came before the edit


def test_a_type_ahead_longer_than_the_message_sent_gives_the_same_reply(smollm_fp32, plain):
    ids, stats = run(smollm_fp32, lambda c: c.type_ahead(f"{TEXT} And why is it so slow here?"))
    assert ids == plain[TEXT]
    assert stats.draft_tokens > 0


def test_a_replaced_type_ahead_gives_the_same_reply(smollm_fp32, plain):
    def type_aheads(chat: Chat) -> None:
        chat.type_ahead("Tell me a story about a lighthouse keeper and his cat.")
        chat.type_ahead(f"{DOC}\n\nWhat")

    ids, stats = run(smollm_fp32, type_aheads)
    assert ids == plain[TEXT]
    assert stats.draft_tokens > 0


def test_a_cancelled_type_ahead_gives_the_same_reply(smollm_fp32, plain):
    def cancelled(chat: Chat) -> None:
        chat.type_ahead(TEXT, wait=False)
        chat.service.end_type_ahead(chat.sid)

    ids, _ = run(smollm_fp32, cancelled)
    assert ids == plain[TEXT]


def test_a_type_ahead_evicted_before_its_turn_gives_the_same_reply(smollm_fp32, plain):
    def evicted(chat: Chat) -> None:
        chat.type_ahead(TEXT)
        other = chat.service.create_session("other")
        chat.say("Write a long list of every fruit you know, one per line, with colours.", other)

    page = small_engine(smollm_fp32, page_size=16)
    pages_bytes = page.store.page_bytes()
    page.close()
    # room for the turn (and the other session's turn) but not for both and the type-ahead
    ids, stats = run(smollm_fp32, evicted, device_cache_bytes=16 * pages_bytes, host_cache_bytes=0)
    assert ids == plain[TEXT]
    assert stats.draft_tokens < stats.prompt_tokens - 16


def test_a_follow_up_type_ahead_gives_the_same_reply(smollm_fp32):
    def conversation(with_type_ahead: bool) -> tuple[tuple[int, ...], TurnStats]:
        chat = Chat(smollm_fp32)
        try:
            chat.say(TEXT)
            if with_type_ahead:
                chat.type_ahead("Name the oth")
            stats = chat.say(FOLLOW_UP)
            return chat.ids(), stats
        finally:
            chat.close()

    without, _ = conversation(False)
    with_type_ahead, stats = conversation(True)
    assert with_type_ahead == without
    assert stats.draft_tokens > 0
