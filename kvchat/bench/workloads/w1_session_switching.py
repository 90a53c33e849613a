"""W1, session switching: four long conversations, answered one turn at a time, round robin.

Each session opens with a document (a standard-library module cut to the planned
length) and a summary question, then gets rounds of short follow-ups in turn, so
every follow-up lands on a conversation another one displaced. What W1 shows is the
cost of coming back: kvchat's follow-up computes only its new tokens plus the one
that ended the previous reply, where a peer that keeps one context re-prefills the
whole history. W4 and W6 reuse `w1_once` with other cache sizes.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from kvchat.bench import documents as docs
from kvchat.bench.chart import log_line_chart
from kvchat.bench.peers.base import ChatEngine, TurnResult
from kvchat.bench.table import (
    Column,
    engine_table,
    median_number,
    number,
    peak_rss_columns,
    peak_rss_note,
)
from kvchat.bench.workloads.context import BenchContext
from kvchat.bench.workloads.plan import BenchPlan
from kvchat.bench.workloads.repeats import chat_run, record_peaks, repeat_interleaved
from kvchat.bench.workloads.workload import Chart, Workload


def _turn_record(session: int, turn: int, r: TurnResult) -> dict:
    return {
        "session": session,
        "turn": turn,
        "ttft_s": r.ttft_s,
        "total_s": r.total_s,
        "prompt_tokens": r.prompt_tokens,
        "prefilled_tokens": r.prefilled_tokens,
        "new_tokens": r.new_tokens,
        "generated_tokens": r.generated_tokens,
        "engine_ttft_s": r.engine_ttft_s,
    }


def w1_once(chat: ChatEngine, openers: list[str], plan: BenchPlan) -> dict:
    """W1 on one engine: documents first, then round-robin follow-ups."""
    sessions = [chat.new_session() for _ in openers]
    turns: list[dict] = []
    start = time.perf_counter()
    for i, (session, text) in enumerate(zip(sessions, openers, strict=True)):
        turns.append(_turn_record(i, 1, chat.turn(session, text, plan.answer_tokens)))
    for r in range(plan.rounds):
        question = docs.FOLLOW_UPS[r % len(docs.FOLLOW_UPS)]
        for i, session in enumerate(sessions):
            turns.append(_turn_record(i, r + 2, chat.turn(session, question, plan.answer_tokens)))
    total = time.perf_counter() - start
    follow = [t for t in turns if t["turn"] > 1]
    return {
        "total_s": total,
        "ttft_first_turn_s": statistics.median(t["ttft_s"] for t in turns if t["turn"] == 1),
        "ttft_follow_up_s": statistics.median(t["ttft_s"] for t in follow) if follow else 0.0,
        "ttft_follow_up_max_s": max((t["ttft_s"] for t in follow), default=0.0),
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "prefilled_tokens": sum(t["prefilled_tokens"] for t in turns),
        "prefilled_follow_up_tokens": sum(t["prefilled_tokens"] for t in follow),
        # the claim: a follow-up computes its new tokens plus the one that ended the last reply
        "follow_up_excess_prefill": max(
            (t["prefilled_tokens"] - t["new_tokens"] for t in follow), default=0
        ),
        "ttft_per_turn_s": [t["ttft_s"] for t in turns],
        "turns": turns,
    }


def w1_capacity(ctx: BenchContext, openers: list[str]) -> int:
    """Tokens the conversations reach: every document, then each turn's question and answer."""
    plan = ctx.plan
    per_turn = plan.answer_tokens + 48
    return sum(
        len(docs.user_prompt_ids(ctx.model, o)) + (plan.rounds + 1) * per_turn for o in openers
    )


def run_w1(ctx: BenchContext) -> dict:
    plan = ctx.plan
    openers = docs.w1_openers(ctx.model.tokenizer, plan.doc_tokens)
    capacity = w1_capacity(ctx, openers)
    engines = {
        name: chat_run(lambda p=peer: p.chat(capacity), lambda c: w1_once(c, openers, plan))
        for name, peer in [("kvchat", ctx.kvchat), *ctx.chat_peers.items()]
    }
    out = repeat_interleaved(ctx, "W1", engines)
    record_peaks(out, {"kvchat": ctx.kvchat, **ctx.chat_peers})
    out["documents"] = {"files": list(docs.W1_FILES), "tokens_each": plan.doc_tokens}
    out["rounds"] = plan.rounds
    out["answer_tokens"] = plan.answer_tokens
    base = out["engines"].get("kvchat", {}).get("median", {}).get("total_s")
    for entry in out["engines"].values():
        if base:
            entry["total_vs_kvchat"] = entry["median"]["total_s"] / base
    return out


def w1_table(w: dict) -> list[str]:
    columns = [
        median_number("total (s)", "total_s", 1),
        Column("vs kvchat", lambda e: f"{e.get('total_vs_kvchat', 1.0):.2f}x"),
        median_number("TTFT, first turn (s)", "ttft_first_turn_s"),
        median_number("TTFT, follow-up (s)", "ttft_follow_up_s", 3),
        median_number("slowest follow-up (s)", "ttft_follow_up_max_s", 3),
        median_number("prefilled tokens", "prefilled_tokens"),
        median_number("follow-up prefill beyond new tokens", "follow_up_excess_prefill"),
        *peak_rss_columns(w["engines"]),
    ]
    documents = w.get("documents", {})
    lines = [
        f"## W1: 4 sessions, {number(documents.get('tokens_each'))}-token documents, "
        f"{w.get('rounds')} rounds of follow-ups, {w.get('answer_tokens')}-token answers",
        "",
        *engine_table(w["engines"], "engine", columns),
        *peak_rss_note(w["engines"]),
    ]
    ours = w["engines"].get("kvchat")
    if ours:
        turns = ours["runs"][0]["turns"]
        per_turn = ", ".join(f"{t['prefilled_tokens']} ({t['new_tokens']} new)" for t in turns)
        lines += ["", f"kvchat prefilled tokens per turn (first run): {per_turn}."]
    return lines


def plot_ttft_per_turn(w: dict, path: Path) -> str | None:
    """TTFT per turn per engine; returns why it was skipped, or None."""
    lines = {}
    for name, e in w["engines"].items():
        ttft = e["median"]["ttft_per_turn_s"]
        lines[name] = (range(1, len(ttft) + 1), ttft)
    return log_line_chart(
        path,
        lines,
        xlabel="turn (4 documents, then follow-ups round robin)",
        ylabel="time to first token (s)",
        title="W1: TTFT per turn",
    )


W1 = Workload(
    "W1",
    run_w1,
    w1_table,
    Chart("W1 TTFT per turn", "w1_ttft.png", plot_ttft_per_turn),
)
