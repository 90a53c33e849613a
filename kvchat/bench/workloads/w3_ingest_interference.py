"""W3, interference: what a long prompt's ingest does to the sessions already streaming.

Three sessions stream while a fourth ingests a long document; the streams'
inter-token latency p99 during the ingest is compared with the same streams alone,
measured on both sides of the ingest with as many gaps as during it. kvchat only:
the peers run one request at a time, so the streams would wait for the whole ingest.
"""

from __future__ import annotations

from kvchat.bench import documents as docs
from kvchat.bench.table import engine_table, median_ms, median_number, median_ratio, number
from kvchat.bench.workloads.context import BenchContext
from kvchat.bench.workloads.repeats import repeat_interleaved
from kvchat.bench.workloads.workload import Workload

SERIAL_ONLY = "runs one request at a time, so the streams wait for the whole ingest"


def run_w3(ctx: BenchContext) -> dict:
    plan, model = ctx.plan, ctx.model
    streams = [docs.user_prompt_ids(model, q) for q in docs.W3_QUESTIONS]
    code = docs.first_tokens(
        docs.stdlib_text(docs.W3_INGEST_FILE), model.tokenizer, plan.w3_ingest_tokens
    )
    ingest = docs.user_prompt_ids(model, docs.fenced(code, docs.SUMMARY_QUESTION))

    def run() -> dict:
        result = ctx.kvchat.interference(streams, ingest, plan.w3_baseline_tokens)
        alone = result["itl_p99_alone_s"]
        result["p99_ratio"] = result["itl_p99_ingest_s"] / alone if alone else 0.0
        return result

    out = repeat_interleaved(ctx, "W3", {"kvchat": run})
    for name in [*ctx.chat_peers, *ctx.speed_peers]:
        out["not_applicable"][name] = SERIAL_ONLY
    out["streams"] = len(streams)
    return out


def w3_table(w: dict) -> list[str]:
    columns = [
        median_ms("ITL p50 alone (ms)", "itl_p50_alone_s"),
        median_ms("ITL p99 alone (ms)", "itl_p99_alone_s"),
        median_ms("ITL p50 during ingest (ms)", "itl_p50_ingest_s"),
        median_ms("ITL p99 during ingest (ms)", "itl_p99_ingest_s"),
        median_ratio("p99 ratio", "p99_ratio"),
        median_number("ingest (s)", "ingest_s"),
    ]
    ingest = next(iter(w["engines"].values()), {}).get("median", {}).get("ingest_tokens")
    return [
        f"## W3: {w.get('streams')} streams while one session ingests a {number(ingest)}-token "
        "prompt",
        "",
        *engine_table(w["engines"], "engine", columns),
    ]


W3 = Workload("W3", run_w3, w3_table)
