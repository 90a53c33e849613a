"""W5, restart: follow-up TTFT after kvchat quits and a new process opens the same files.

Four long conversations get one turn each; kvchat quits cleanly (the disk tier
finishes its writes), then a new kvchat process (`restart_phase.py`) loads the same
model with the same engine settings, opens the same database and disk-tier folder,
and asks each conversation one follow-up. With the disk tier the history comes back
from disk (cold: the page cache dropped between the two processes; and hot); without
it everything is recomputed; transformers saves each conversation's
`past_key_values` with `torch.save` and loads it back, the load in its TTFT.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvchat.bench import documents as docs
from kvchat.bench.peers.base import NotApplicable, TurnResult
from kvchat.bench.peers.kvchat import TURN_TIMEOUT_S
from kvchat.bench.restart_phase import RestartSpec, engine_fields, run_in_new_process
from kvchat.bench.table import MISSING, Column, engine_table, median_number, number
from kvchat.bench.workloads.context import BenchContext, scratch_folder
from kvchat.bench.workloads.repeats import repeat_interleaved
from kvchat.bench.workloads.workload import Workload
from kvchat.errors import KvchatError

RESTART_TIMEOUT_S = 5 * TURN_TIMEOUT_S  # the model's load and four follow-ups
SCRATCH_PREFIX = "w5-"


def drop_page_cache(folder: Path) -> str:
    """Make the next reads of `folder`'s files come from the disk; returns how it was done.

    As root, the OS page cache is dropped whole; otherwise each file's cached pages
    are dropped with posix_fadvise(DONTNEED), which is what the report then says.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise(DONTNEED)"


def _follow_up_summary(first: list[TurnResult], follow: list[TurnResult], cold: str) -> dict:
    return {
        "ttft_follow_up_s": statistics.median(r.ttft_s for r in follow),
        "ttft_follow_up_max_s": max(r.ttft_s for r in follow),
        "ttft_per_follow_up_s": [r.ttft_s for r in follow],
        "ttft_first_turn_s": statistics.median(r.ttft_s for r in first),
        "prompt_tokens_follow_up": sum(r.prompt_tokens for r in follow),
        "prefilled_follow_up_tokens": sum(r.prefilled_tokens for r in follow),
        "cached_disk_follow_up_tokens": sum(r.cached_disk_tokens for r in follow),
        "page_cache": cold,
        "replies": [r.text for r in follow],
    }


def w5_kvchat(ctx: BenchContext, openers: list[str], *, disk: bool, cold: bool) -> dict:
    """Four long conversations, kvchat closed, then a new kvchat process on the same
    database and disk-tier folder asks the follow-ups (`restart_phase`)."""
    plan, peer = ctx.plan, ctx.kvchat
    if ctx.model_load is None:
        raise KvchatError("W5 needs how the model was loaded, to load it in a new process")
    work = scratch_folder(ctx, SCRATCH_PREFIX)
    try:
        kv, db = work / "kv", work / "sessions.sqlite3"
        capacity = sum(len(docs.user_prompt_ids(ctx.model, o)) for o in openers) + 4 * (
            2 * plan.answer_tokens + 128
        )
        folder = kv if disk else None
        chat = peer.chat(capacity, disk_dir=folder, store_path=db)
        try:
            sessions = [chat.new_session() for _ in openers]
            first = [
                chat.turn(s, o, plan.answer_tokens) for s, o in zip(sessions, openers, strict=True)
            ]
        finally:
            chat.close()  # a clean quit: the disk tier finishes its writes
        how = drop_page_cache(work) if cold else "hot"
        spec = RestartSpec(  # the same engine as the first phase's, in a new process
            model=ctx.model_load,
            engine=engine_fields(peer.config(capacity, disk_dir=folder)),
            store_path=str(db),
            sessions=tuple(sessions),
            text=docs.FOLLOW_UPS[0],
            max_tokens=plan.answer_tokens,
        )
        restart = run_in_new_process(spec, work, RESTART_TIMEOUT_S)
        summary = _follow_up_summary(first, restart.turns, how if disk else "none")
        summary["restart_pid"] = restart.pid
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


def w5_transformers(ctx: BenchContext, openers: list[str], *, cold: bool) -> dict:
    """transformers as a careful user scripts it: past_key_values `torch.save`d per
    conversation at quit, `torch.load`ed back after the restart (the load is in the TTFT)."""
    import torch

    from kvchat.bench.peers.hf_cache import HfCacheChat, HfCachePeer, _Session

    peer = ctx.chat_peers.get("transformers-cache")
    if not isinstance(peer, HfCachePeer):
        raise NotApplicable("needs the transformers-cache peer")
    plan = ctx.plan
    work = scratch_folder(ctx, SCRATCH_PREFIX)
    try:
        chat = HfCacheChat(peer.hf)
        sessions = [chat.new_session() for _ in openers]
        first = [
            chat.turn(s, o, plan.answer_tokens) for s, o in zip(sessions, openers, strict=True)
        ]
        for i, s in enumerate(sessions):
            kv = [(layer.keys, layer.values) for layer in s.cache.layers]
            state = {"messages": s.messages, "ids": s.cached_ids, "seen": s.seen, "kv": kv}
            torch.save(state, work / f"conversation-{i}.pt")
        del sessions, chat
        how = drop_page_cache(work) if cold else "hot"
        chat = HfCacheChat(peer.hf)  # the restart
        follow: list[TurnResult] = []
        for i in range(len(openers)):
            start = time.perf_counter()
            state = torch.load(work / f"conversation-{i}.pt", weights_only=True)
            session = chat.new_session()
            for layer, (k, v) in enumerate(state["kv"]):
                session.cache.update(k, v, layer)
            session = _Session(state["messages"], state["ids"], session.cache, state["seen"])
            loaded = time.perf_counter() - start
            r = chat.turn(session, docs.FOLLOW_UPS[0], plan.answer_tokens)
            follow.append(replace(r, ttft_s=r.ttft_s + loaded, total_s=r.total_s + loaded))
        return _follow_up_summary(first, follow, how)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_w5(ctx: BenchContext) -> dict:
    """W5: follow-up TTFT after a restart, with the disk tier (page cache dropped, and hot),
    without it (everything recomputed), and transformers with torch.save'd caches."""
    plan = ctx.plan
    openers = docs.w1_openers(ctx.model.tokenizer, plan.w5_doc_tokens)
    engines: dict[str, Callable[[], dict]] = {
        "kvchat, disk tier, cold": lambda: w5_kvchat(ctx, openers, disk=True, cold=True),
        "kvchat, disk tier, hot": lambda: w5_kvchat(ctx, openers, disk=True, cold=False),
        "kvchat, no disk tier": lambda: w5_kvchat(ctx, openers, disk=False, cold=False),
    }
    if "transformers-cache" in ctx.chat_peers:
        engines["transformers, torch.save, cold"] = lambda: w5_transformers(ctx, openers, cold=True)
        engines["transformers, torch.save, hot"] = lambda: w5_transformers(ctx, openers, cold=False)
    out = repeat_interleaved(ctx, "W5", engines)
    base = out["engines"].get("kvchat, no disk tier", {}).get("median", {})
    for name, entry in out["engines"].items():
        if base.get("ttft_follow_up_s"):
            entry["ttft_vs_recompute"] = (
                entry["median"]["ttft_follow_up_s"] / base["ttft_follow_up_s"]
            )
        replies = entry["runs"][0]["replies"]
        if name.startswith("kvchat") and base.get("replies") and replies:
            same = sum(a == b for a, b in zip(replies, base["replies"], strict=False))
            entry["replies_same_as_recompute"] = f"{same}/{len(replies)}"
    out["documents"] = {"files": list(docs.W1_FILES), "tokens_each": plan.w5_doc_tokens}
    out["answer_tokens"] = plan.answer_tokens
    for name in ctx.chat_peers:
        if name != "transformers-cache":
            out["not_applicable"][name] = "W5 compares kvchat with transformers' saved caches"
    return out


def _vs_recompute(entry: dict) -> str:
    ratio = entry.get("ttft_vs_recompute")
    return MISSING if ratio is None else f"{ratio:.3f}"


def w5_table(w: dict) -> list[str]:
    columns = [
        median_number("TTFT, follow-up after restart (s)", "ttft_follow_up_s", 3),
        median_number("slowest (s)", "ttft_follow_up_max_s", 3),
        Column("vs recompute", _vs_recompute),
        median_number("from disk (tokens)", "cached_disk_follow_up_tokens"),
        median_number("prefilled (tokens)", "prefilled_follow_up_tokens"),
        Column("page cache", lambda e: str(e["median"]["page_cache"])),
        Column("replies as recompute", lambda e: e.get("replies_same_as_recompute", MISSING)),
    ]
    doc = w.get("documents", {})
    return [
        f"## W5: restart with {len(doc.get('files', []))} conversations of "
        f"{number(doc.get('tokens_each'))} tokens",
        "",
        "kvchat quits cleanly, then a new kvchat process opens the same database and "
        "disk-tier folder (the page cache dropped between the two processes for the cold "
        "row) and asks one follow-up per conversation; TTFT from the follow-up's start to "
        "its first token, the new process's model load not in it, as the peers' figures "
        "hold no model load either (transformers' restart stays in the bench's process, "
        "its `torch.load` in the TTFT).",
        "",
        *engine_table(w["engines"], "engine", columns),
    ]


W5 = Workload("W5", run_w5, w5_table)
