"""What every benchmarked engine answers, and the values it answers with.

The workloads (`bench/workloads/`) drive engines only through these types, so
kvchat and each peer are measured by the same code: the same turns in the same
order, TTFT taken the same way (from the start of a turn, templating included,
to the first generated token), decode rates over the same span (after the
first token). Results are frozen dataclasses: they cross from the peers into
the report unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PeerUnavailable(Exception):
    """The peer cannot run here (package missing, wrong model kind); the message says why."""


class NotApplicable(Exception):
    """The engine has no way to run this workload (e.g. no batching); the message says why."""


@dataclass(frozen=True)
class TurnResult:
    """One chat turn as the user saw it."""

    ttft_s: float  # start of the turn (templating included) -> first generated token
    total_s: float  # start of the turn -> last generated token
    prompt_tokens: int  # the whole prompt of this turn
    prefilled_tokens: int  # prompt tokens the engine computed for this turn
    new_tokens: int  # prompt tokens not in the session's previous prompt + reply
    generated_tokens: int
    engine_ttft_s: float | None = None  # the engine's own submit -> first token, when it has one
    draft_tokens: int = 0  # prompt tokens served from type-aheads' pages (kvchat only)
    text: str = ""  # the reply
    cached_disk_tokens: int = 0  # prompt tokens read back from kvchat's disk tier


@dataclass(frozen=True)
class SpeedResult:
    """Prefill rate per prompt length (logits of the last token only) and batch-1 decode,
    after the long prompt and from a short one (a conversation's start, where attention
    costs least: what llama-bench's tg figures measure)."""

    prefill_tok_s: dict[int, float]
    decode_tok_s: float
    short_decode_tok_s: float | None = None


@dataclass(frozen=True)
class BatchResult:
    """Several sequences generating at once (W2)."""

    sequences: int
    tokens_each: int
    decode_tok_s: float  # tokens after every sequence's first / span from then to the end
    wall_s: float  # submit -> last token, prefill included

    @property
    def wall_tok_s(self) -> float:
        return self.sequences * self.tokens_each / self.wall_s if self.wall_s > 0 else 0.0


def batch_from_deltas(
    deltas: Sequence[Sequence[float]], generated: Sequence[int], tokens_each: int, start: float
) -> BatchResult:
    """W2's figures from streamed text: each sequence's delta times and its token count.

    A server streams text, one delta a token on the servers kvchat is tested with;
    a delta adds its sequence's share (tokens over deltas) to the rate after every
    sequence's first token. `start` is when the first request was sent.
    """
    all_first = max(times[0] for times in deltas)
    end = max(times[-1] for times in deltas)
    after = sum(
        n / len(times) * sum(1 for t in times if t > all_first)
        for times, n in zip(deltas, generated, strict=True)
    )
    rate = after / (end - all_first) if end > all_first else 0.0
    return BatchResult(len(deltas), tokens_each, rate, end - start)


def concurrent_on_fresh_chat(
    peer: ChatPeer, questions: Sequence[str], tokens_each: int, capacity_tokens: int
) -> BatchResult:
    """W2 on a server: a fresh chat (nothing cached), a conversation per question, at once."""
    chat = peer.chat(capacity_tokens)
    try:
        return chat.concurrent(questions, tokens_each)  # type: ignore[attr-defined]
    finally:
        chat.close()


class ChatEngine(Protocol):
    """Sessions kept the way this engine's users keep them; one turn at a time."""

    def new_session(self) -> object: ...

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        """Send `text` as the user's next message; greedy, exactly `max_tokens` tokens."""
        ...

    def close(self) -> None: ...


class ChatPeer(Protocol):
    """An engine that keeps conversations (W1, the sweep)."""

    name: str
    description: str  # one line for the report: what it is and how it keeps state

    def chat(self, capacity_tokens: int) -> ChatEngine:
        """A fresh chat with nothing cached; `capacity_tokens` bounds what it must hold."""
        ...

    def close(self) -> None: ...


class SpeedPeer(Protocol):
    """An engine measured on raw speed (speed) and batched generation (W2).

    `batch` raises `NotApplicable` when the engine cannot run sequences together.
    """

    name: str
    description: str

    def speed(
        self,
        prompt_ids: Sequence[int],
        prefill_lengths: Sequence[int],
        decode_prompt: int,
        decode_tokens: int,
    ) -> SpeedResult: ...

    def batch(self, prompts: Sequence[Sequence[int]], tokens_each: int) -> BatchResult: ...

    def close(self) -> None: ...


SHORT_DECODE_PROMPT = 16  # tokens before the short-context decode


class SpeedMeasured:
    """The speed workload, measured the same way for every peer that derives from this.

    Each prefill length runs once to set its shape up, then once timed
    (`_prefill_seconds`). Then one batch-1 generation of `decode_tokens` after
    `decode_prompt` tokens, and one after the first `SHORT_DECODE_PROMPT`: `_decode_span`
    gives (time of the first token, time of the last, tokens generated), and the rate
    counts the tokens after the first.
    """

    def _prefill_seconds(self, ids: Sequence[int]) -> float:
        raise NotImplementedError

    def _decode_span(self, ids: Sequence[int], tokens: int) -> tuple[float, float, int]:
        raise NotImplementedError

    def speed(
        self,
        prompt_ids: Sequence[int],
        prefill_lengths: Sequence[int],
        decode_prompt: int,
        decode_tokens: int,
    ) -> SpeedResult:
        prefill: dict[int, float] = {}
        for n in prefill_lengths:
            self._prefill_seconds(prompt_ids[:n])  # the first call of a shape sets it up
            prefill[n] = n / self._prefill_seconds(prompt_ids[:n])
        long = self._decode_rate(prompt_ids[:decode_prompt], decode_tokens)
        short = self._decode_rate(prompt_ids[:SHORT_DECODE_PROMPT], decode_tokens)
        return SpeedResult(prefill, long, short)

    def _decode_rate(self, ids: Sequence[int], tokens: int) -> float:
        first, last, made = self._decode_span(ids, tokens)
        return (made - 1) / (last - first) if made > 1 else 0.0
