"""The engine's immutable stats snapshot (docs/kv-cache.md, "Metric definitions").

One meaning everywhere: the UI meters, the headless `stats` event and the bench
all read these fields. The cache's counters are the page table's own frozen set
(`CacheCounters`), embedded as they are; figures per tier are `PerTier` values.
Counters only grow; rates come from the difference of two snapshots
(`decode_tok_s`/`prefill_tok_s` here are already such a windowed rate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvchat.engine.cache.cache_counters import CacheCounters, Evictions, hit_rate
from kvchat.engine.per_tier import PerTier

__all__ = [
    "CacheCounters",
    "DiskBytes",
    "EngineStats",
    "Evictions",
    "Residency",
    "TierPages",
    "hit_rate",
    "no_pages",
]


@dataclass(frozen=True)
class TierPages:
    """Pages (or host slots) of one tier; `active + cached + free == capacity`."""

    capacity: int = 0
    active: int = 0  # referenced by a live request (always 0 on the host tier)
    cached: int = 0  # unreferenced, with content a later request can match (the prompt cache)
    free: int = 0  # holding nothing


def no_pages() -> PerTier[TierPages]:
    """Pages of an engine whose tiers are all off (or not reported)."""
    return PerTier(TierPages(), TierPages(), TierPages())


@dataclass(frozen=True)
class Residency(PerTier[int]):
    """Where a token history's K/V is: on the device, only on the host, only on disk, nowhere."""

    device: int = 0
    host: int = 0
    disk: int = 0
    nowhere: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.nowhere


@dataclass(frozen=True)
class DiskBytes:
    capacity: int = 0
    used: int = 0  # every page file in the folder (all models share the capacity)


@dataclass(frozen=True)
class EngineStats:
    cache: CacheCounters = field(default_factory=CacheCounters)
    generated_tokens: int = 0
    pages: PerTier[TierPages] = field(default_factory=no_pages)
    disk_bytes: DiskBytes = field(default_factory=DiskBytes)
    disk_notice: str | None = None  # why the disk tier stopped writing, once it has
    requests: dict[str, int] = field(default_factory=dict)  # RequestState value -> count
    preemptions: int = 0
    drafts: int = 0  # type-aheads waiting to be computed (named as the stats event names it)
    decode_tok_s: float = 0.0  # over the last few seconds
    prefill_tok_s: float = 0.0
    page_size: int = 0
    time: float = 0.0
    # a model whose windowed layers are kept apart: their slots (held, idle, free) and how
    # many idle parts were let go for a slot another page wanted
    window: TierPages | None = None
    window_let_go: int = 0
    # a hybrid model: its linear layers' states kept at page ends, and their bytes
    states_kept: int = 0
    state_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """sum(cached_tokens) / prompt_tokens, cumulative; 0 before any prompt."""
        return self.cache.hit_rate

    def to_json(self) -> dict[str, object]:
        """The headless `stats` event body (docs/architecture.md): these names, nested objects."""
        c = self.cache
        return {
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": asdict(c.cached_tokens),
            "prefilled_tokens": c.prefilled_tokens,
            "recomputed_tokens": c.recomputed_tokens,
            "generated_tokens": self.generated_tokens,
            "pages": asdict(self.pages),
            "evictions": asdict(c.evictions),
            "disk_bytes": asdict(self.disk_bytes),
            "disk_notice": self.disk_notice,
            "requests": dict(self.requests),
            "preemptions": self.preemptions,
            "draft_tokens": c.draft_tokens,
            "draft_reused_tokens": c.draft_reused_tokens,
            "drafts": self.drafts,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "page_size": self.page_size,
            "time": self.time,
            "window_slots": asdict(self.window) if self.window is not None else None,
            "window_let_go": self.window_let_go,
            "states_kept": self.states_kept,
            "state_bytes": self.state_bytes,
            "hit_rate": self.hit_rate,
        }
