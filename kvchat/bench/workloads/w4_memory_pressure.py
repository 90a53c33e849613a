"""W4, memory pressure: W1 with the device cache at half its working set.

Three configurations of kvchat alone: everything on the device; half the working set
on the device with the host tier on (sized to the whole working set), and with it
off. The first measures the working set that sizes the other two. Reported: hit
rate, time, where the cached tokens came from, and the evictions each way.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvchat.bench import documents as docs
from kvchat.bench.table import Column, engine_table, median_number, median_share, number
from kvchat.bench.workloads.context import BenchContext
from kvchat.bench.workloads.repeats import chat_run, repeat_interleaved
from kvchat.bench.workloads.w1_session_switching import w1_capacity, w1_once
from kvchat.bench.workloads.workload import Workload

W4_ONLY = "kvchat's own cache tiers under pressure; the peers have no such tiers"


def run_w4(ctx: BenchContext) -> dict:
    """W1 with the device cache at half its working set: host tier on, off; all on device."""
    plan, peer = ctx.plan, ctx.kvchat
    openers = docs.w1_openers(ctx.model.tokenizer, plan.doc_tokens)
    capacity = w1_capacity(ctx, openers)
    page_bytes = peer.page_bytes()
    sizing: dict[str, int] = {}

    def configured(device_bytes: int | None, host_bytes: int | None, measure: bool = False):
        def body(chat) -> dict:
            result = w1_once(chat, openers, plan)
            stats = chat.stats()
            if measure and not sizing:
                lengths = chat.working_set_tokens()
                pages = sum(math.ceil(n / peer.page_size) for n in lengths)
                biggest = max(math.ceil(n / peer.page_size) for n in lengths)
                sizing["working_set_pages"] = pages
                sizing["device_pages"] = max(math.ceil(pages / 2), biggest + 2)
            return {
                "total_s": result["total_s"],
                "ttft_follow_up_s": result["ttft_follow_up_s"],
                "hit_rate": stats.hit_rate,
                "prompt_tokens": stats.cache.prompt_tokens,
                "cached_device_tokens": stats.cache.cached_tokens.device,
                "cached_host_tokens": stats.cache.cached_tokens.host,
                "prefilled_tokens": stats.cache.prefilled_tokens,
                "recomputed_tokens": stats.cache.recomputed_tokens,
                "device_pages": stats.pages.device.capacity,
                "host_pages": stats.pages.host.capacity,
                "evictions": {
                    "device_to_host": stats.cache.evictions.device_to_host,
                    "host_dropped": stats.cache.evictions.host_dropped,
                    "device_dropped": stats.cache.evictions.device_dropped,
                },
            }

        return chat_run(
            lambda: peer.chat(capacity, device_bytes=device_bytes, host_bytes=host_bytes), body
        )

    def half(host: bool) -> Callable[[], dict]:
        def run() -> dict:
            if not sizing:  # the all-on-device run measures the working set first
                configured(None, 0, measure=True)()
            device = sizing["device_pages"] * page_bytes
            host_bytes = (sizing["working_set_pages"] + 8) * page_bytes if host else 0
            return configured(device, host_bytes)()

        return run

    everything = (math.ceil(capacity / peer.page_size) + 8) * page_bytes
    engines = {
        "all on device": configured(everything, 0, measure=True),
        "half, host tier on": half(True),
        "half, host tier off": half(False),
    }
    out = repeat_interleaved(ctx, "W4", engines)
    out.update(sizing)
    out["page_size"] = peer.page_size
    for name in ctx.chat_peers:
        out["not_applicable"][name] = W4_ONLY
    return out


def _evictions(entry: dict) -> str:
    ev = entry["median"]["evictions"]
    return (
        f"{number(ev['device_to_host'])} / {number(ev['host_dropped'])} / "
        f"{number(ev['device_dropped'])}"
    )


def w4_table(w: dict) -> list[str]:
    columns = [
        median_number("device pages", "device_pages"),
        median_number("host pages", "host_pages"),
        median_share("hit rate", "hit_rate"),
        median_number("total (s)", "total_s", 1),
        median_number("TTFT, follow-up (s)", "ttft_follow_up_s", 3),
        median_number("from host (tokens)", "cached_host_tokens"),
        median_number("prefilled", "prefilled_tokens"),
        Column("evictions d→h / h✗ / d✗", _evictions),
    ]
    return [
        f"## W4: W1 with the device cache at half its working set "
        f"({number(w.get('working_set_pages'))} pages of {w.get('page_size')} tokens)",
        "",
        *engine_table(w["engines"], "device cache", columns),
    ]


W4 = Workload("W4", run_w4, w4_table)
