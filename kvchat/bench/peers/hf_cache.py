"""transformers with each session's `past_key_values` kept in RAM between turns.

What a careful transformers app does: one `DynamicCache` per session; each turn
renders and tokenizes the whole conversation (as `apply_chat_template` users
do), keeps the cache's longest prefix shared with the new ids (a reply
re-tokenized from its text can differ from the ids generated), crops the rest
and lets `generate` compute only the new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvchat.bench.peers.base import TurnResult
from kvchat.bench.peers.hf_model import HfModel
from kvchat.engine.token_ids import common_prefix


@dataclass
class _Session:
    messages: list[dict[str, str]] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)  # the ids whose K/V the cache holds
    cache: object = None
    seen: int = 0


class HfCacheChat:
    def __init__(self, hf: HfModel) -> None:
        self.hf = hf

    def new_session(self) -> _Session:
        from transformers import DynamicCache

        return _Session(cache=DynamicCache())

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        assert isinstance(session, _Session)
        start = time.perf_counter()
        messages = [*session.messages, {"role": "user", "content": text}]
        ids = self.hf.encode_chat(messages)
        keep = min(common_prefix(session.cached_ids, ids), len(ids) - 1)
        drop = len(session.cached_ids) - keep
        if drop > 0:
            session.cache.crop(-drop)  # a negative count removes that many tokens
        first, generated = self.hf.generate(ids, max_tokens, cache=session.cache)
        end = time.perf_counter()
        session.messages = [*messages, {"role": "assistant", "content": self.hf.decode(generated)}]
        session.cached_ids = [*ids, *generated[:-1]]  # the last token's K/V is never computed
        new = len(ids) - session.seen
        session.seen = len(ids) + len(generated)
        return TurnResult(
            first - start, end - start, len(ids), len(ids) - keep, new, len(generated)
        )

    def close(self) -> None:
        pass


class HfCachePeer:
    name = "transformers-cache"

    def __init__(self, hf: HfModel) -> None:
        self.hf = hf
        self.description = f"{hf.description}, per-session past_key_values kept in RAM"

    def chat(self, capacity_tokens: int) -> HfCacheChat:
        return HfCacheChat(self.hf)

    def close(self) -> None:
        pass
