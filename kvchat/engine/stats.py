"""The engine's immutable stats snapshot (docs/kv-cache.md, "Metric definitions").

One meaning everywhere: the UI meters, the headless `stats` event and the bench
all read these fields. Counters only grow; rates come from the difference of two
snapshots (`decode_tok_s`/`prefill_tok_s` here are already such a windowed rate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvchat.engine.events import CachedTokens


def hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """The share of prompt tokens served from a cache tier: cached / prompt (0.0 before any)."""
    return cached_tokens / prompt_tokens if prompt_tokens else 0.0


@dataclass(frozen=True)
class TierPages:
    """Pages (or host slots) of one tier; `active + cached + free == capacity`."""

    capacity: int = 0
    active: int = 0  # referenced by a live request (always 0 on the host tier)
    cached: int = 0  # unreferenced, with content a later request can match (the prompt cache)
    free: int = 0  # holding nothing


@dataclass(frozen=True)
class Residency:
    """Where a token history's K/V is: on the device, only on the host, only on disk, nowhere."""

    device: int = 0
    host: int = 0
    nowhere: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.nowhere


@dataclass(frozen=True)
class Evictions:
    device_to_host: int = 0
    host_dropped: int = 0  # pages lost entirely when they left the host tier
    device_dropped: int = 0
    host_to_disk: int = 0  # pages that left the host tier with a copy on disk
    disk_dropped: int = 0  # page files removed to make room on disk


@dataclass(frozen=True)
class DiskBytes:
    capacity: int = 0
    used: int = 0  # every page file in the folder (all models share the capacity)


@dataclass(frozen=True)
class EngineStats:
    prompt_tokens: int = 0
    cached_tokens: CachedTokens = field(default_factory=CachedTokens)
    prefilled_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    pages: dict[str, TierPages] = field(default_factory=dict)  # "device", "host", "disk"
    evictions: Evictions = field(default_factory=Evictions)
    disk_bytes: DiskBytes = field(default_factory=DiskBytes)
    disk_notice: str | None = None  # why the disk tier stopped writing, once it has
    requests: dict[str, int] = field(default_factory=dict)  # RequestState value -> count
    preemptions: int = 0
    draft_tokens: int = 0  # computed by drafts (type-ahead); never in prompt or prefilled tokens
    draft_reused_tokens: int = 0  # prompt tokens served from pages drafts computed (in cached)
    drafts: int = 0  # drafts waiting to be computed
    decode_tok_s: float = 0.0  # over the last few seconds
    prefill_tok_s: float = 0.0
    page_size: int = 0
    time: float = 0.0

    @property
    def hit_rate(self) -> float:
        """sum(cached_tokens) / prompt_tokens, cumulative; 0 before any prompt."""
        return hit_rate(self.cached_tokens.total, self.prompt_tokens)

    def to_json(self) -> dict[str, object]:
        """The headless `stats` event body (docs/architecture.md): these names, nested objects."""
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out
