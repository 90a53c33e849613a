"""W6, more conversations than the RAM tiers hold: what the disk tier brings back.

W1's pattern over sixteen different documents, with device and host tiers far
smaller than the conversations: without the disk tier most follow-ups recompute
their history; with it they read it back. Follow-up TTFT (median and p95) and the
total time, with the disk tier and without. kvchat only: the peers keep no tiers.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import replace

from kvchat.bench import documents as docs
from kvchat.bench.peers.kvchat import percentile
from kvchat.bench.table import Column, engine_table, median_number, median_share, number
from kvchat.bench.workloads.context import BenchContext, scratch_folder
from kvchat.bench.workloads.repeats import repeat_interleaved
from kvchat.bench.workloads.w1_session_switching import w1_capacity, w1_once
from kvchat.bench.workloads.workload import Workload

W6_ONLY = "kvchat's disk tier against its RAM tiers alone; the peers keep no tiers"
SCRATCH_PREFIX = "w6-"


def run_w6(ctx: BenchContext) -> dict:
    """W1's pattern over 16 different documents with small device and host tiers: follow-up
    TTFT (median, p95) and total time with the disk tier and without."""
    plan, peer = ctx.plan, ctx.kvchat
    files = docs.W6_FILES[: plan.w6_sessions]
    openers = docs.w1_openers(ctx.model.tokenizer, plan.w6_doc_tokens, files)
    w6_plan = replace(plan, rounds=plan.w6_rounds)
    capacity = w1_capacity(ctx, openers)
    page_bytes = peer.page_bytes()
    per_session = math.ceil(capacity / len(openers) / peer.page_size) + 1
    # --quick: RAM tiers for about three of the conversations, so most must come from disk
    device = plan.w6_device_bytes or (2 * per_session + 2) * page_bytes
    host = plan.w6_host_bytes or per_session * page_bytes

    def configured(disk: bool) -> Callable[[], dict]:
        def run() -> dict:
            work = scratch_folder(ctx, SCRATCH_PREFIX) if disk else None
            try:
                chat = peer.chat(
                    capacity,
                    device_bytes=device,
                    host_bytes=host,
                    disk_dir=None if work is None else work / "kv",
                )
                try:
                    result = w1_once(chat, openers, w6_plan)
                    stats = chat.stats()
                finally:
                    chat.close()
            finally:
                if work is not None:
                    shutil.rmtree(work, ignore_errors=True)
            follow = [t["ttft_s"] for t in result["turns"] if t["turn"] > 1]
            return {
                "total_s": result["total_s"],
                "ttft_follow_up_s": result["ttft_follow_up_s"],
                "ttft_follow_up_p95_s": percentile(follow, 95),
                "prefilled_follow_up_tokens": result["prefilled_follow_up_tokens"],
                "hit_rate": stats.hit_rate,
                "cached_tokens": {
                    "device": stats.cache.cached_tokens.device,
                    "host": stats.cache.cached_tokens.host,
                    "disk": stats.cache.cached_tokens.disk,
                },
                "evictions": {
                    "device_to_host": stats.cache.evictions.device_to_host,
                    "host_dropped": stats.cache.evictions.host_dropped,
                    "host_to_disk": stats.cache.evictions.host_to_disk,
                },
            }

        return run

    out = repeat_interleaved(
        ctx,
        "W6",
        {"kvchat, disk tier on": configured(True), "kvchat, disk tier off": configured(False)},
    )
    on = out["engines"].get("kvchat, disk tier on", {}).get("median", {})
    off = out["engines"].get("kvchat, disk tier off", {}).get("median", {})
    if on and off and off.get("ttft_follow_up_p95_s"):
        out["p95_on_vs_off"] = on["ttft_follow_up_p95_s"] / off["ttft_follow_up_p95_s"]
    out["sessions"] = len(openers)
    out["documents"] = {"files": list(files), "tokens_each": plan.w6_doc_tokens}
    out["rounds"] = plan.w6_rounds
    out["device_cache_bytes"] = device
    out["host_cache_bytes"] = host
    for name in ctx.chat_peers:
        out["not_applicable"][name] = W6_ONLY
    return out


def w6_table(w: dict) -> list[str]:
    columns = [
        median_number("total (s)", "total_s", 1),
        median_number("TTFT follow-up median (s)", "ttft_follow_up_s", 3),
        median_number("p95 (s)", "ttft_follow_up_p95_s", 3),
        median_share("hit rate", "hit_rate"),
        Column("from disk (tokens)", lambda e: number(e["median"]["cached_tokens"]["disk"])),
        median_number("prefilled, follow-ups", "prefilled_follow_up_tokens"),
    ]
    doc = w.get("documents", {})
    device_mib = number(w.get("device_cache_bytes", 0) / 2**20, 0)
    host_mib = number(w.get("host_cache_bytes", 0) / 2**20, 0)
    return [
        f"## W6: {w.get('sessions')} conversations of {number(doc.get('tokens_each'))} tokens, "
        f"{w.get('rounds')} rounds, device cache {device_mib} MiB, host {host_mib} MiB",
        "",
        *engine_table(w["engines"], "configuration", columns),
    ]


W6 = Workload("W6", run_w6, w6_table)
