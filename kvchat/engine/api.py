"""The engine's public API: all that the chat layer, the TUI and the headless mode use of it.

Requests and sampling parameters go in, events and stats snapshots come out, and
`Residency` says where a history's K/V lives. Everything here is a plain frozen
value with no torch behind it, so importing this module (and with it `kvchat.chat`
or `kvchat.tui`) never loads torch; the `Engine` class itself is started by
`kvchat.runtime`. Above the engine, nothing imports another `kvchat.engine` module.
"""

from __future__ import annotations

from kvchat.engine.events import (
    CachedTokens,
    EngineEvent,
    PrefillProgress,
    RequestFinished,
    RequestStarted,
    TokenGenerated,
    TypeAheadProgress,
)
from kvchat.engine.per_tier import TIERS, PerTier
from kvchat.engine.request import FinishReason, GenerationRequest, RequestState, SamplingParams
from kvchat.engine.stats import (
    CacheCounters,
    EngineStats,
    Evictions,
    Residency,
    TierPages,
    hit_rate,
)
from kvchat.engine.token_ids import common_prefix

__all__ = [
    "TIERS",
    "CacheCounters",
    "CachedTokens",
    "EngineEvent",
    "EngineStats",
    "Evictions",
    "FinishReason",
    "GenerationRequest",
    "PerTier",
    "PrefillProgress",
    "RequestFinished",
    "RequestStarted",
    "RequestState",
    "Residency",
    "SamplingParams",
    "TierPages",
    "TokenGenerated",
    "TypeAheadProgress",
    "common_prefix",
    "hit_rate",
]
