"""speed: prefill and batch-1 decode rates, against the bound the memory bandwidth sets.

Prefill computes the logits of the last token only, for prompts of code of each
planned length; decode generates a fixed number of tokens after a long prompt and
after a short one (llama-bench's tg figures start from an empty context). The
machine's memory read bandwidth, measured with a large torch reduction, over the
weight bytes a decode step streams, bounds the decode rate; the report gives each
engine's share of that bound, in the engine's own weight format, and each engine
process's peak memory.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from kvchat.bench import documents as docs
from kvchat.bench.machine import (
    dense_weight_bytes_per_token,
    memory_bandwidth_gbs,
    weight_bytes_per_token,
)
from kvchat.bench.peers.base import SHORT_DECODE_PROMPT
from kvchat.bench.table import (
    Column,
    engine_table,
    median_number,
    number,
    peak_rss_columns,
    peak_rss_note,
)
from kvchat.bench.workloads.context import BenchContext
from kvchat.bench.workloads.repeats import record_peaks, repeat_interleaved
from kvchat.bench.workloads.workload import Workload
from kvchat.units import format_size


def run_speed(ctx: BenchContext) -> dict:
    """Prefill (last token's logits) and batch-1 decode rates, plus the bandwidth bound."""
    plan, model = ctx.plan, ctx.model
    ids = docs.code_ids(model, max(*plan.prefill_lengths, plan.decode_prompt))
    device = model.transformer.device.type
    bandwidth = [
        memory_bandwidth_gbs(plan.bandwidth_bytes, device=device) for _ in range(plan.repeats)
    ]

    def one(peer) -> Callable[[], dict]:
        def run() -> dict:
            s = peer.speed(ids, plan.prefill_lengths, plan.decode_prompt, plan.decode_tokens)
            return {
                "prefill_tok_s": {str(n): v for n, v in s.prefill_tok_s.items()},
                "decode_tok_s": s.decode_tok_s,
                "short_decode_tok_s": s.short_decode_tok_s,
            }

        return run

    peers = {"kvchat": ctx.kvchat, **ctx.kvchat_variants, **ctx.speed_peers}
    out = repeat_interleaved(ctx, "speed", {name: one(peer) for name, peer in peers.items()})
    record_peaks(out, peers)
    gbs = statistics.median(bandwidth)
    wbytes = weight_bytes_per_token(model.transformer)
    out["memory_bandwidth_gbs"] = {"runs": bandwidth, "median": gbs}
    out["weight_bytes_per_token"] = wbytes
    out["decode_bound_tok_s"] = gbs * 1e9 / wbytes
    for name, entry in out["engines"].items():
        streamed = _streamed_bytes(peers[name], model)
        entry["weight_bytes_per_token"] = streamed
        entry["bandwidth_fraction"] = entry["median"]["decode_tok_s"] * streamed / (gbs * 1e9)
    out["prompt_lengths"] = list(plan.prefill_lengths)
    out["decode"] = {
        "prompt": plan.decode_prompt,
        "short_prompt": SHORT_DECODE_PROMPT,
        "tokens": plan.decode_tokens,
    }
    return out


def _streamed_bytes(peer, model) -> int:
    """Weight bytes a decode step of this engine reads (its own format)."""
    own = getattr(peer, "weight_bytes", None)
    if callable(own):  # llama.cpp: its GGUF file
        return int(own())
    kvchat_model = getattr(peer, "model", None)
    if hasattr(kvchat_model, "transformer"):
        return weight_bytes_per_token(kvchat_model.transformer)
    return dense_weight_bytes_per_token(model.config, model.dtype)  # transformers


def _prefill(length: str) -> Column:
    return Column(
        f"prefill {length} (tok/s)",
        lambda entry: number(entry["median"]["prefill_tok_s"].get(length)),
    )


def speed_table(w: dict) -> list[str]:
    columns = [
        *(_prefill(str(n)) for n in w.get("prompt_lengths", [])),
        median_number("decode, batch 1 (tok/s)", "decode_tok_s", 1),
        Column(
            "decode from a short prompt (tok/s)",
            lambda e: number(e["median"].get("short_decode_tok_s"), 1),
        ),
        Column("share of the bandwidth bound", lambda e: f"{e['bandwidth_fraction']:.0%}"),
        *peak_rss_columns(w["engines"]),
    ]
    bw = w["memory_bandwidth_gbs"]["median"]
    decode = w.get("decode", {})
    return [
        "## Speed",
        "",
        *engine_table(w["engines"], "engine", columns),
        "",
        f"Prefill: logits of the last token only. Decode: {decode.get('tokens')} tokens after a "
        f"{decode.get('prompt')}-token prompt, and after a {decode.get('short_prompt')}-token "
        "one (llama-bench's tg figures start from an empty context). Memory read bandwidth "
        f"(torch): {bw:.1f} GB/s; "
        f"{format_size(w['weight_bytes_per_token'])} of weights per token, so decode is bound "
        f"near {w['decode_bound_tok_s']:.0f} tok/s (llama.cpp streams its own quantized file).",
        *peak_rss_note(w["engines"]),
    ]


SPEED = Workload("speed", run_speed, speed_table)
