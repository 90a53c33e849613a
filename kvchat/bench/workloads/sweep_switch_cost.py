"""sweep: the cost of switching back to a conversation, against the length of its history.

For each planned length, conversation A opens with that much of one module, B with
as much of another (switching away), then A gets its first follow-up; the figure is
that follow-up's TTFT. An engine that keeps every conversation's cache answers in
about the same time at every length; one that keeps a single context re-prefills A's
whole history, so its line climbs with the length.
"""

from __future__ import annotations

from pathlib import Path

from kvchat.bench import documents as docs
from kvchat.bench.chart import log_line_chart
from kvchat.bench.table import markdown_table, number
from kvchat.bench.workloads.context import BenchContext, disk_variant
from kvchat.bench.workloads.repeats import repeat_interleaved
from kvchat.bench.workloads.workload import Chart, Workload


def sweep_once(peer, histories: dict[int, tuple[str, str]], answer: int) -> dict:
    """Per length: A with its history, B with its own (switch away), then A again."""
    points = []
    for length, (text_a, text_b) in histories.items():
        chat = peer.chat(2 * (length + 4 * answer + 128))
        try:
            a = chat.new_session()
            first = chat.turn(a, text_a, answer)
            b = chat.new_session()
            chat.turn(b, text_b, answer)
            back = chat.turn(a, docs.FOLLOW_UPS[0], answer)
        finally:
            chat.close()
        points.append(
            {
                "length": length,
                "history_tokens": first.prompt_tokens + first.generated_tokens,
                "ttft_s": back.ttft_s,
                "prefilled_tokens": back.prefilled_tokens,
                "first_turn_ttft_s": first.ttft_s,
            }
        )
    return {"points": points, "ttft_s": [p["ttft_s"] for p in points]}


def run_sweep(ctx: BenchContext) -> dict:
    a_file, b_file = docs.SWEEP_FILES
    histories = {
        n: (docs.history_of(ctx.model, a_file, n), docs.history_of(ctx.model, b_file, n))
        for n in ctx.plan.sweep_lengths
    }
    answer = ctx.plan.sweep_answer_tokens
    engines = {
        name: (lambda p=peer: sweep_once(p, histories, answer))
        for name, peer in [("kvchat", ctx.kvchat), *disk_variant(ctx), *ctx.chat_peers.items()]
    }
    out = repeat_interleaved(ctx, "sweep", engines)
    out["lengths"] = list(ctx.plan.sweep_lengths)
    return out


def sweep_table(w: dict) -> list[str]:
    # one column per length, so the cells are the median's list, not named columns
    header = ["engine", *(f"{n:,} tokens" for n in w.get("lengths", []))]
    rows = [
        [name, *(number(v, 3) for v in e["median"]["ttft_s"])] for name, e in w["engines"].items()
    ]
    return [
        "## Switch cost against history length",
        "",
        "TTFT (s) of a follow-up in conversation A after a turn in conversation B.",
        "",
        *markdown_table(header, rows),
    ]


def plot_switch_cost(w: dict, path: Path) -> str | None:
    """Follow-up TTFT after a switch against history length, per engine."""
    return log_line_chart(
        path,
        {name: (w["lengths"], e["median"]["ttft_s"]) for name, e in w["engines"].items()},
        xlabel="history length (tokens)",
        ylabel="TTFT of a follow-up after a switch (s)",
        title="Switch cost against history length",
    )


SWEEP = Workload(
    "sweep",
    run_sweep,
    sweep_table,
    Chart("switch cost", "sweep_ttft.png", plot_switch_cost),
)
