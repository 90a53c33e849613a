"""The KV cache's counters: one frozen set, kept by the page table and embedded in `EngineStats`.

The counters follow the metric definitions of docs/kv-cache.md exactly, so the engine, the UI,
the headless output and the bench all read one meaning: `prompt_tokens` is split
into tokens served from a tier (`cached_tokens`, per tier) and tokens computed
(`prefilled_tokens`); recompute after preemption or requeue is counted apart in
`recomputed_tokens` and never enters the hit rate. Counters only grow; rates come
from the difference of two snapshots.

Why frozen: the page table replaces its set at each change instead of mutating it, so
the set it hands out is already the snapshot, and the engine embeds it as it is
rather than copying it field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from kvchat.engine.events import CachedTokens

# where a page went when it left a tier (`device_to_disk`: no host room, kept on disk)
EvictionKind = Literal[
    "device_to_host", "device_to_disk", "device_dropped", "host_to_disk", "host_dropped"
]


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """The share of prompt tokens served from a cache tier: cached / prompt (0.0 before any)."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass(frozen=True)
class Evictions:
    """Pages that left a tier, by where they went (monotonic)."""

    device_to_host: int = 0  # device pages evicted to the host tier (copied, or already there)
    host_dropped: int = 0  # pages lost entirely when they left the host tier
    device_dropped: int = 0  # device pages evicted with nowhere to go (partial, or no room)
    host_to_disk: int = 0  # pages that left the host tier with a copy on disk
    disk_dropped: int = 0  # page files removed to make room on disk

    def plus(self, **counts: int) -> Evictions:
        """These counters grown by the given amounts."""
        return replace(self, **{name: getattr(self, name) + n for name, n in counts.items()})


@dataclass(frozen=True)
class CacheCounters:
    """What the cache served, computed and evicted since the engine started."""

    prompt_tokens: int = 0  # tokens of admitted prompts, once per turn
    cached_tokens: CachedTokens = field(default_factory=CachedTokens)  # served, per tier
    prefilled_tokens: int = 0  # prompt tokens that had to be computed
    recomputed_tokens: int = 0  # tokens computed again for preempted or requeued sequences
    draft_tokens: int = 0  # tokens type-aheads computed (not in prompt_ or prefilled_tokens)
    draft_reused_tokens: int = 0  # prompt tokens served from type-aheads' pages (in cached)
    evictions: Evictions = field(default_factory=Evictions)
    # device pages with no host room that were kept on disk: the page table's own figure,
    # not part of the engine's `evictions` (whose fields the stats event fixes)
    device_to_disk: int = 0

    @property
    def hit_rate(self) -> float:
        """sum(cached_tokens) / prompt_tokens, cumulative; 0 before any prompt."""
        return hit_rate(self.cached_tokens.total, self.prompt_tokens)

    def prompt_admitted(
        self, tokens: int, cached: CachedTokens, type_ahead_reused: int
    ) -> CacheCounters:
        """A turn's prompt of `tokens` tokens was admitted, `cached` of them served by tiers."""
        had = self.cached_tokens
        return replace(
            self,
            prompt_tokens=self.prompt_tokens + tokens,
            cached_tokens=CachedTokens(
                (had.device or 0) + (cached.device or 0),
                (had.host or 0) + (cached.host or 0),
                (had.disk or 0) + (cached.disk or 0),
            ),
            prefilled_tokens=self.prefilled_tokens + tokens - cached.total,
            draft_reused_tokens=self.draft_reused_tokens + type_ahead_reused,
        )

    def plus(self, **counts: int) -> CacheCounters:
        """These (plain integer) counters grown by the given amounts."""
        return replace(self, **{name: getattr(self, name) + n for name, n in counts.items()})

    def evicted(self, **counts: int) -> CacheCounters:
        """These eviction counters grown by the given amounts."""
        return replace(self, evictions=self.evictions.plus(**counts))

    def eviction(self, kind: EvictionKind) -> CacheCounters:
        """One more page that left a tier this way."""
        if kind == "device_to_disk":
            return self.plus(device_to_disk=1)
        return self.evicted(**{kind: 1})
