"""The engine's mutable bookkeeping for one sequence: a request, or a type-ahead.

Only the engine thread touches a `Sequence`. Its invariant: `tokens` is the
prompt plus every generated token; K/V exist for `tokens[:num_computed]`; the
next forward feeds `tokens[num_computed:]` (a prefill chunk, or the one token
sampled last), so a preempted sequence resumes by re-reserving `tokens`.

A type-ahead (`Sequence.for_type_ahead`) is a sequence that produces no tokens: a
prompt computed ahead while the user is still typing it. The scheduler runs it at
background priority and it holds pages only within the step that computes its chunk
(`kvchat/engine/scheduler.py`); it reports `TypeAheadProgress` instead of a request's
events, and finishes without a `RequestFinished`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvchat.engine.events import (
    CachedTokens,
    EngineEvent,
    RequestFinished,
    RequestStarted,
    TypeAheadProgress,
)
from kvchat.engine.request import FinishReason, GenerationRequest, RequestState
from kvchat.model.detokenizer import IncrementalDetokenizer


class Sequence:
    def __init__(
        self,
        request_id: int,
        request: GenerationRequest,
        on_event: Callable[[EngineEvent], None] | Callable[[TypeAheadProgress], None],
        detokenizer: IncrementalDetokenizer | None,
        stop_ids: frozenset[int],
        *,
        type_ahead: bool = False,
    ):
        self.id = request_id
        self.request = request
        self.on_event = on_event
        self.detokenizer = detokenizer
        self.stop_ids = frozenset() if request.ignore_eos else stop_ids | request.stop_token_ids
        self.tokens: list[int] = list(request.prompt_ids)
        self.prompt_len = len(request.prompt_ids)
        self.num_computed = 0
        self.state = RequestState.QUEUED
        # produces no tokens, runs at background priority, holds pages only within a step
        self.type_ahead = type_ahead
        self.measured = False  # a type-ahead: what the cache already holds was looked up
        self.admitted = False  # reserved at least once (later reservations are recompute)
        self.skipped = 0  # times a later request was admitted ahead of this one
        self.since_admission = 0  # tokens generated since the last (re)admission
        self.cached = CachedTokens()
        self.prefilled_tokens = 0
        self.type_ahead_tokens = 0  # prompt tokens served from pages type-aheads computed
        self.recomputed_tokens = 0
        self.text = ""  # emitted text so far
        self.pending_text = ""  # decoded but held back: might be the start of a stop string
        self.submit_time = time.monotonic()
        self.first_token_time: float | None = None
        seed = request.sampling.seed
        self.generator: torch.Generator | None = None
        if not request.sampling.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(
                seed if seed is not None else int.from_bytes(_random_bytes(), "little")
            )

    @classmethod
    def for_type_ahead(
        cls,
        seq_id: int,
        token_ids: tuple[int, ...],
        on_progress: Callable[[TypeAheadProgress], None],
    ) -> Sequence:
        """A prompt to compute ahead: nothing is generated, `on_progress` hears how far it is."""
        request = GenerationRequest(token_ids, max_tokens=0)
        return cls(seq_id, request, on_progress, None, frozenset(), type_ahead=True)

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.num_computed

    def samples_after(self, n: int) -> bool:
        """Whether feeding the next `n` tokens ends in a token to sample (never for a
        type-ahead): only a chunk that reaches the end of the tokens needs logits."""
        return not self.type_ahead and self.num_computed + n == len(self.tokens)

    def emit(self, event: EngineEvent | TypeAheadProgress) -> None:
        self.on_event(event)  # type: ignore[arg-type]

    def announce_start(self) -> None:
        """A request's first event. A type-ahead has none: its first is its progress, once
        what the cache holds of it was looked up."""
        if not self.type_ahead:
            self.emit(RequestStarted(self.id, time.monotonic()))

    def report_progress(self) -> None:
        """A type-ahead's progress: how many of its tokens the cache holds now."""
        self.emit(TypeAheadProgress(self.id, self.num_computed, len(self.tokens), time.monotonic()))

    def finished_event(
        self, reason: FinishReason, error: str | None, now: float
    ) -> RequestFinished:
        """A request's last event, with its figures; a cancelled or failed one keeps the
        text it held back for a stop string."""
        generated = self.generated_ids
        first = self.first_token_time
        ttft = None if first is None else first - self.submit_time
        decode_rate = None
        if first is not None and len(generated) > 1 and now > first:
            decode_rate = (len(generated) - 1) / (now - first)
        if reason == FinishReason.CANCELLED or reason == FinishReason.ERROR:
            self.text += self.pending_text
            self.pending_text = ""
        return RequestFinished(
            request_id=self.id,
            reason=reason,
            prompt_tokens=self.prompt_len if self.admitted else 0,
            cached_tokens=self.cached,
            prefilled_tokens=self.prefilled_tokens,
            recomputed_tokens=self.recomputed_tokens,
            generated_ids=tuple(generated),
            text=self.text,
            ttft_s=ttft,
            decode_tok_s=decode_rate,
            time=now,
            error=error,
            draft_tokens=self.type_ahead_tokens,
        )


def _random_bytes() -> bytes:
    import os

    return os.urandom(8)
