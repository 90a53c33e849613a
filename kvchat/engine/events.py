"""Events the engine streams back per request (frozen: they cross threads).

The engine calls the request's callback from its own thread; a consumer must
only hand the event over (queue, `post_message`), never do slow work in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.per_tier import PerTier
from kvchat.engine.request import FinishReason


@dataclass(frozen=True)
class CachedTokens(PerTier[int | None]):
    """Prompt tokens served without compute, by the tier they came from.

    None: the backend does not report that tier (a remote server reports one count).
    """

    device: int | None = 0
    host: int | None = 0
    disk: int | None = 0

    @property
    def total(self) -> int:
        return (self.device or 0) + (self.host or 0) + (self.disk or 0)

    @property
    def reported(self) -> bool:
        return not (self.device is None and self.host is None and self.disk is None)


@dataclass(frozen=True)
class RequestStarted:
    request_id: int
    time: float  # time.monotonic()


@dataclass(frozen=True)
class PrefillProgress:
    request_id: int
    done_tokens: int  # prompt tokens now in the cache (cached + computed so far)
    total_tokens: int
    time: float


@dataclass(frozen=True)
class TokenGenerated:
    request_id: int
    text: str  # decoded delta; never splits a UTF-8 character
    token_ids: tuple[int, ...]
    time: float


@dataclass(frozen=True)
class RequestFinished:
    request_id: int
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: CachedTokens
    prefilled_tokens: int | None  # prompt tokens computed; prompt = cached.total + prefilled
    # recompute caused by preemption or requeue (not in the hit rate); None: not reported
    recomputed_tokens: int | None
    generated_ids: tuple[int, ...]  # includes the stop token when the reply ended on one
    text: str
    ttft_s: float | None
    decode_tok_s: float | None
    time: float
    error: str | None = None
    # prompt tokens served from pages that type-aheads computed (also in cached_tokens); the
    # name is the headless `reply` event's
    draft_tokens: int = 0

    @property
    def generated_tokens(self) -> int:
        return len(self.generated_ids)


@dataclass(frozen=True)
class TypeAheadProgress:
    """How much of a type-ahead (a prompt computed while it is typed) is in the cache: sent
    as it grows."""

    type_ahead_id: int
    ready_tokens: int  # its tokens whose K/V is computed (or was found cached)
    total_tokens: int
    time: float

    @property
    def done(self) -> bool:
        return self.ready_tokens >= self.total_tokens


EngineEvent = RequestStarted | PrefillProgress | TokenGenerated | RequestFinished
