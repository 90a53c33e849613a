"""transformers as a naive chat app uses it: the whole history re-run every turn.

Each turn renders the whole conversation with the chat template, tokenizes it
and calls `generate` on all of it: nothing is kept between turns but the text,
so every turn prefills the full history (the first peer of docs/benchmarks.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvchat.bench.peers.base import TurnResult
from kvchat.bench.peers.hf_model import HfModel


@dataclass
class _Session:
    messages: list[dict[str, str]] = field(default_factory=list)
    seen: int = 0  # tokens of the previous prompt + its reply


class HfNaiveChat:
    def __init__(self, hf: HfModel) -> None:
        self.hf = hf

    def new_session(self) -> _Session:
        return _Session()

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        assert isinstance(session, _Session)
        start = time.perf_counter()
        messages = [*session.messages, {"role": "user", "content": text}]
        ids = self.hf.encode_chat(messages)
        first, generated = self.hf.generate(ids, max_tokens)
        end = time.perf_counter()
        session.messages = [*messages, {"role": "assistant", "content": self.hf.decode(generated)}]
        new = len(ids) - session.seen
        session.seen = len(ids) + len(generated)
        return TurnResult(first - start, end - start, len(ids), len(ids), new, len(generated))

    def close(self) -> None:
        pass


class HfNaivePeer:
    name = "transformers-naive"

    def __init__(self, hf: HfModel) -> None:
        self.hf = hf
        self.description = f"{hf.description}, whole history re-run every turn"

    def chat(self, capacity_tokens: int) -> HfNaiveChat:
        return HfNaiveChat(self.hf)

    def close(self) -> None:
        pass
