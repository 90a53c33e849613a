"""The KV cache's counters and the immutable snapshot the page table hands out.

The counters follow the metric definitions of docs/kv-cache.md exactly, so the engine, the UI,
the headless output and the bench all read one meaning: `prompt_tokens` is split
into tokens served from a tier (`cached_*`) and tokens computed
(`prefilled_tokens`); recompute after preemption or requeue is counted apart in
`recomputed_tokens` and never enters the hit rate. Counters only grow; rates come
from the difference of two snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.stats import TierPages


@dataclass(frozen=True)
class PageTableStats:
    """A snapshot of the page table: page usage per tier, evictions, token counters."""

    device: TierPages
    host: TierPages
    device_to_host: int  # device pages evicted to the host tier (copied, or already there)
    host_dropped: int  # pages lost entirely when their host slot was reused
    device_dropped: int  # device pages evicted with nowhere to go (partial, or no host room)
    prompt_tokens: int  # tokens of admitted prompts, once per turn
    cached_device: int  # prompt tokens served from device pages (shared, cached, tail copies)
    cached_host: int  # prompt tokens served by copying pages back from the host tier
    cached_disk: int  # prompt tokens read back from the disk tier
    prefilled_tokens: int  # prompt tokens that had to be computed
    recomputed_tokens: int  # tokens computed again for preempted or requeued sequences
    draft_tokens: int = 0  # tokens drafts computed (never in prompt_tokens or prefilled_tokens)
    draft_reused_tokens: int = 0  # prompt tokens served from pages drafts computed (in cached_*)
    host_to_disk: int = 0  # pages that left the host tier with a copy on disk
    device_to_disk: int = 0  # device pages with no host room that were kept on disk

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served without compute, all tiers together."""
        return self.cached_device + self.cached_host + self.cached_disk


@dataclass
class CacheCounters:
    """The page table's own mutable counters (one instance per table, never global)."""

    device_to_host: int = 0
    device_dropped: int = 0
    host_to_disk: int = 0
    device_to_disk: int = 0
    prompt_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_disk: int = 0
    prefilled_tokens: int = 0
    recomputed_tokens: int = 0
    draft_tokens: int = 0
    draft_reused_tokens: int = 0
