"""W7, paste then ask: what type-ahead prefill saves a first turn, and what it costs.

Four sessions, one after another on an otherwise idle engine: a ~3,000-token document
is pasted (sent to the engine as a type-ahead, as the TUI does once typing pauses), then,
after the time a person takes to type a 40-character question (8 s at 5 characters a
second), the question is appended and the message sent. The time to first token is
measured from the send, as in W1. The same four turns run without type-ahead, and with
a 2-second pause (a type-ahead that may not be finished); the replies must not change.

Interference is a phase of its own: three sessions stream while a fourth computes a
document ahead; the streams' inter-token latency is compared with the same streams alone
(before and after), as in W3. No peer computes a prompt before it is sent.

The results keep the names earlier results files use: the modes ("no draft",
"draft, 8 s pause"), the phase ("3 streams + a draft") and keys such as `draft_tokens`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence

from kvchat.bench import documents as docs
from kvchat.bench.peers.kvchat import (
    KvchatChat,
    KvchatPeer,
    _drive,
    each_has,
    fresh_engine,
    percentile,
    split_gaps,
    start_streams,
    stop_streams,
)
from kvchat.bench.table import Column, engine_table, median_ms, median_number, median_ratio, number
from kvchat.bench.workloads.context import BenchContext
from kvchat.bench.workloads.repeats import chat_run, repeat_interleaved
from kvchat.bench.workloads.workload import Workload
from kvchat.engine.events import TypeAheadProgress

QUESTION = "Which function here is the most complex?"  # 40 characters
NO_TYPE_AHEAD = "no draft"
NO_PEER = "no peer computes a prompt before it is sent"


def pasted_documents(tokenizer, doc_tokens: int) -> list[str]:
    """The four pasted documents: W1's modules cut to `doc_tokens` tokens, in a code fence."""
    return [
        f"```python\n{docs.first_tokens(docs.stdlib_text(f), tokenizer, doc_tokens)}\n```"
        for f in docs.W1_FILES
    ]


def w7_once(chat: KvchatChat, pasted: list[str], pause_s: float | None, answer: int) -> dict:
    """The four sessions in turn: paste (a type-ahead unless `pause_s` is None), pause, send."""
    turns = []
    for text in pasted:
        session = chat.new_session()
        if pause_s is not None:
            chat.type_ahead(session, text)
            chat.pause(pause_s)
        r = chat.turn(session, f"{text}\n\n{QUESTION}", answer)
        turns.append(
            {
                "ttft_s": r.ttft_s,
                "prompt_tokens": r.prompt_tokens,
                "prefilled_tokens": r.prefilled_tokens,
                "draft_tokens": r.draft_tokens,
                "text": r.text,
            }
        )
    return {
        "ttft_first_turn_s": statistics.median(t["ttft_s"] for t in turns),
        "ttft_per_session_s": [t["ttft_s"] for t in turns],
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "prefilled_tokens": sum(t["prefilled_tokens"] for t in turns),
        "draft_tokens": sum(t["draft_tokens"] for t in turns),
        "replies": [t["text"] for t in turns],
    }


def type_ahead_interference(
    peer: KvchatPeer,
    stream_prompts: Sequence[Sequence[int]],
    type_ahead_ids: Sequence[int],
    baseline_tokens: int,
    window_tokens: int,
) -> dict[str, float | int | bool]:
    """Streams alone, then while a type-ahead is computed (until it is done or each stream has
    produced `window_tokens` more tokens: a type-ahead may wait while streams run), then alone."""
    longest = max(len(p) for p in stream_prompts)
    max_stream = 2 * baseline_tokens + window_tokens + 16
    capacity = len(type_ahead_ids) + len(stream_prompts) * (longest + max_stream + 256)
    progress: list[TypeAheadProgress] = []
    done = threading.Event()

    def on_progress(event: TypeAheadProgress) -> None:
        progress.append(event)
        if event.done:
            done.set()

    with fresh_engine(peer.model, peer.config(capacity)) as engine:
        streams, ids = start_streams(engine, stream_prompts, max_stream)
        _drive(engine, each_has(streams, [baseline_tokens + 2] * len(streams)))
        t_start = time.monotonic()
        ahead_id = engine.type_ahead(tuple(type_ahead_ids), on_progress)
        window = each_has(streams, [len(s.times) + window_tokens for s in streams])
        _drive(engine, lambda: done.is_set() or window())
        t_end = time.monotonic()
        engine.cancel(ahead_id)
        _drive(engine, each_has(streams, [len(s.times) + baseline_tokens + 1 for s in streams]))
        stop_streams(engine, streams, ids)
    alone, during = split_gaps(streams, t_start, t_end)
    p99_alone = percentile(alone, 99)
    p99_during = percentile(during, 99)
    return {
        "itl_p50_alone_s": percentile(alone, 50),
        "itl_p99_alone_s": p99_alone,
        "itl_p50_drafting_s": percentile(during, 50),
        "itl_p99_drafting_s": p99_during,
        "p99_ratio": p99_during / p99_alone if p99_alone else 0.0,
        "draft_tokens": len(type_ahead_ids),
        "draft_ready_tokens": progress[-1].ready_tokens if progress else 0,
        "draft_done": done.is_set(),
        "window_s": t_end - t_start,
        "gaps_alone": len(alone),
        "gaps_drafting": len(during),
    }


def run_w7(ctx: BenchContext) -> dict:
    """W7 on kvchat: TTFT without type-ahead, with an 8 s and a 2 s pause; then interference."""
    plan, model = ctx.plan, ctx.model
    pasted = pasted_documents(model.tokenizer, plan.w7_doc_tokens)
    capacity = sum(
        len(docs.user_prompt_ids(model, f"{t}\n\n{QUESTION}")) + plan.w7_answer_tokens + 64
        for t in pasted
    )
    long_pause = f"draft, {plan.w7_pause_s:g} s pause"
    modes: dict[str, float | None] = {
        NO_TYPE_AHEAD: None,
        long_pause: plan.w7_pause_s,
        f"draft, {plan.w7_short_pause_s:g} s pause": plan.w7_short_pause_s,
    }
    engines = {
        name: chat_run(
            lambda: ctx.kvchat.chat(capacity),
            lambda c, pause=pause: w7_once(c, pasted, pause, plan.w7_answer_tokens),
        )
        for name, pause in modes.items()
    }
    out = repeat_interleaved(ctx, "W7", engines)
    plain = out["engines"].get(NO_TYPE_AHEAD, {}).get("runs", [])
    same = True
    for entry in out["engines"].values():
        for i, run in enumerate(entry["runs"]):
            if i < len(plain) and run["replies"] != plain[i]["replies"]:
                same = False
    out["replies_identical"] = same
    out["sessions"] = len(pasted)
    out["document_tokens"] = plan.w7_doc_tokens
    out["question"] = QUESTION
    out["answer_tokens"] = plan.w7_answer_tokens
    out["pauses_s"] = {name: pause for name, pause in modes.items() if pause is not None}
    out["long_pause_mode"] = long_pause  # the mode the TTFT target is about

    streams = [docs.user_prompt_ids(model, q) for q in docs.W3_QUESTIONS]
    type_ahead_ids = model.renderer.type_ahead_ids([], pasted[0], reply_ended_with_stop=False)

    def interference() -> dict:
        return type_ahead_interference(
            ctx.kvchat, streams, type_ahead_ids, plan.w3_baseline_tokens, plan.w7_window_tokens
        )

    phase = repeat_interleaved(ctx, "W7 interference", {"3 streams + a draft": interference})
    out["interference"] = phase
    for name in [*ctx.chat_peers, *ctx.speed_peers]:
        out["not_applicable"][name] = NO_PEER
    return out


def _slowest(entry: dict) -> str:
    return number(max(entry["median"]["ttft_per_session_s"]), 3)


def _type_ahead_ready(entry: dict) -> str:
    m = entry["median"]
    return f"{number(m['draft_ready_tokens'])} of {number(m['draft_tokens'])}"


def w7_table(w: dict) -> list[str]:
    columns = [
        median_number("TTFT, first turn (s)", "ttft_first_turn_s", 3),
        Column("slowest (s)", _slowest),
        median_number("prefilled", "prefilled_tokens"),
        median_number("from drafts", "draft_tokens"),
    ]
    lines = [
        f"## W7: paste then ask ({w.get('sessions')} sessions, a "
        f"{number(w.get('document_tokens'))}-token document drafted, then a question sent)",
        "",
        *engine_table(w["engines"], "mode", columns),
        "",
        "Replies identical with and without drafts: "
        + ("yes" if w.get("replies_identical") else "no"),
    ]
    interference = [
        median_ms("ITL p99 alone (ms)", "itl_p99_alone_s"),
        median_ms("ITL p99 while drafting (ms)", "itl_p99_drafting_s"),
        median_ratio("p99 ratio", "p99_ratio"),
        Column("draft ready (tokens)", _type_ahead_ready),
    ]
    for name, e in w.get("interference", {}).get("engines", {}).items():
        lines += ["", *engine_table({name: e}, "interference", interference)]
    return lines


W7 = Workload("W7", run_w7, w7_table)
