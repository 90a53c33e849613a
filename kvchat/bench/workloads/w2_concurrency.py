"""W2, concurrency: eight sessions with one short question each, generating at once.

The figure is the aggregate decode rate: kvchat and transformers decode the eight as
one batch, the serving engines get them as concurrent streamed chat requests. The
wall rate (prefill included) and wall time are reported beside it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvchat.bench import documents as docs
from kvchat.bench.table import engine_table, median_number, peak_rss_columns, peak_rss_note
from kvchat.bench.workloads.context import BenchContext, disk_variant
from kvchat.bench.workloads.repeats import record_peaks, repeat_interleaved
from kvchat.bench.workloads.workload import Workload


def run_w2(ctx: BenchContext) -> dict:
    plan = ctx.plan
    questions = [docs.W2_QUESTIONS[i % len(docs.W2_QUESTIONS)] for i in range(plan.w2_sessions)]
    prompts = [docs.user_prompt_ids(ctx.model, q) for q in questions]

    def one(peer) -> Callable[[], dict]:
        def run() -> dict:
            b = peer.batch(prompts, plan.w2_tokens)
            return {"decode_tok_s": b.decode_tok_s, "wall_s": b.wall_s, "wall_tok_s": b.wall_tok_s}

        return run

    def sessions(peer) -> Callable[[], dict]:
        """A chat peer that takes text (the servers): one conversation per question, at once."""

        def run() -> dict:
            capacity = sum(len(p) + plan.w2_tokens for p in prompts)
            b = peer.concurrent(questions, plan.w2_tokens, capacity)
            return {"decode_tok_s": b.decode_tok_s, "wall_s": b.wall_s, "wall_tok_s": b.wall_tok_s}

        return run

    engines = {"kvchat": one(ctx.kvchat)} | {n: one(p) for n, p in disk_variant(ctx)}
    engines |= {n: one(p) for n, p in ctx.speed_peers.items()}
    engines |= {n: sessions(p) for n, p in ctx.chat_peers.items() if hasattr(p, "concurrent")}
    out = repeat_interleaved(ctx, "W2", engines)
    record_peaks(
        out,
        {"kvchat": ctx.kvchat, **dict(disk_variant(ctx)), **ctx.speed_peers, **ctx.chat_peers},
    )
    out["sessions"] = plan.w2_sessions
    out["tokens_each"] = plan.w2_tokens
    return out


def w2_table(w: dict) -> list[str]:
    columns = [
        median_number("aggregate decode (tok/s)", "decode_tok_s", 1),
        median_number("wall, prefill included (tok/s)", "wall_tok_s", 1),
        median_number("wall (s)", "wall_s"),
        *peak_rss_columns(w["engines"]),
    ]
    return [
        f"## W2: {w.get('sessions')} sessions generating {w.get('tokens_each')} tokens at once",
        "",
        *engine_table(w["engines"], "engine", columns),
        *peak_rss_note(w["engines"]),
    ]


W2 = Workload("W2", run_w2, w2_table)
