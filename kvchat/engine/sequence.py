"""The engine's mutable bookkeeping for one running request.

Only the engine thread touches a `Sequence`. Its invariant: `tokens` is the
prompt plus every generated token; K/V exist for `tokens[:num_computed]`; the
next forward feeds `tokens[num_computed:]` (a prefill chunk, or the one token
sampled last), so a preempted sequence resumes by re-reserving `tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvchat.engine.events import CachedTokens, EngineEvent
from kvchat.engine.request import GenerationRequest, RequestState
from kvchat.model.detokenizer import IncrementalDetokenizer


class Sequence:
    def __init__(
        self,
        request_id: int,
        request: GenerationRequest,
        on_event: Callable[[EngineEvent], None],
        detokenizer: IncrementalDetokenizer,
        stop_ids: frozenset[int],
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
        self.admitted = False  # reserved at least once (later reservations are recompute)
        self.skipped = 0  # times a later request was admitted ahead of this one
        self.since_admission = 0  # tokens generated since the last (re)admission
        self.cached = CachedTokens()
        self.prefilled_tokens = 0
        self.draft_tokens = 0  # prompt tokens served from pages drafts computed
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

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.num_computed

    def emit(self, event: EngineEvent) -> None:
        self.on_event(event)


def _random_bytes() -> bytes:
    import os

    return os.urandom(8)
