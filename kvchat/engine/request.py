"""What a caller asks the engine for: token ids, sampling parameters, limits and stops.

Requests are immutable values; the engine's own per-request bookkeeping lives in
`engine/sequence.py`, so a caller can never mutate a request the engine is running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class RequestState(StrEnum):
    """The words used for a request's state everywhere: engine, headless output, UI."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached, or the context is full
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. temperature 0 is greedy (the other knobs are then unused)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None  # same seed, same output, whatever else is in the batch

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: the full prompt (the engine finds what of it is cached) and its limits."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()  # added to the model's own end-of-turn tokens
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
