"""The bench's workloads (docs/benchmarks.md), each run for every engine that can run it, repeated.

One function per workload takes the `BenchContext` and returns a JSON-ready dict:
`{"engines": {name: {"runs": [...], "median": {...}}}, "not_applicable": {name:
reason}, "errors": {name: message}, ...}`. Repeats are interleaved (repeat 1 of
every engine, then repeat 2...), so a noisy stretch of the machine falls on all
engines alike. Every engine is driven by the same code here; what differs is
only how each keeps its state (`peers/`).

Sizes live in `BenchPlan`: the full plan is the one docs/benchmarks.md describes; `--quick`
shrinks every workload (short documents, one round, few tokens, one repeat) but keeps each
one's entry, so the JSON always has the same shape.

It stays one module on purpose: the workloads share the plan, the context and the
interleaved `_repeat`, and side by side they show that every engine meets the same
driver. What only kvchat runs with machinery of its own lives apart: W7's drafts and
streams (`type_ahead.py`) and W5's restarted process (`restart_phase.py`).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvchat.bench import documents as docs
from kvchat.bench.machine import (
    dense_weight_bytes_per_token,
    memory_bandwidth_gbs,
    weight_bytes_per_token,
)
from kvchat.bench.peers.base import (
    SHORT_DECODE_PROMPT,
    ChatEngine,
    ChatPeer,
    NotApplicable,
    SpeedPeer,
    TurnResult,
)
from kvchat.bench.peers.kvchat import TURN_TIMEOUT_S, KvchatPeer
from kvchat.bench.restart_phase import (
    ModelLoad,
    RestartSpec,
    engine_fields,
    run_in_new_process,
)
from kvchat.bench.type_ahead import run_w7
from kvchat.errors import KvchatError

WORKLOAD_NAMES = ("speed", "W1", "sweep", "W2", "W3", "W4", "W5", "W6", "W7")
SERIAL_ONLY = "runs one request at a time, so the streams wait for the whole ingest"
W4_ONLY = "kvchat's own cache tiers under pressure; the peers have no such tiers"
W6_ONLY = "kvchat's disk tier against its RAM tiers alone; the peers keep no tiers"
RESTART_TIMEOUT_S = 5 * TURN_TIMEOUT_S  # the model's load and four follow-ups
DISK_NAME = "kvchat+disk"  # kvchat with its disk tier on, beside kvchat without (sweep, W2)


@dataclass(frozen=True)
class BenchPlan:
    """Every size the workloads use (the full plan, or reduced for --quick)."""

    quick: bool = False
    repeats: int = 3
    prefill_lengths: tuple[int, ...] = (512, 2048)
    decode_prompt: int = 512
    decode_tokens: int = 128
    bandwidth_bytes: int = 512 << 20
    doc_tokens: int = 3000
    rounds: int = 3
    answer_tokens: int = 32
    sweep_lengths: tuple[int, ...] = (1024, 2048, 4096, 6144)
    sweep_answer_tokens: int = 8
    w2_sessions: int = 8
    w2_tokens: int = 128
    w3_ingest_tokens: int = 4000
    w3_baseline_tokens: int = 160  # each stream, alone, before and again after the ingest
    w7_doc_tokens: int = 3000  # the pasted document
    w7_pause_s: float = 8.0  # a 40-character question typed at 5 characters a second
    w7_short_pause_s: float = 2.0
    w7_answer_tokens: int = 32
    w7_window_tokens: int = 400  # streams' tokens at most while the draft is computed
    w5_doc_tokens: int = 6000
    w6_sessions: int = 16
    w6_doc_tokens: int = 4000
    w6_rounds: int = 3
    w6_device_bytes: int | None = 256 << 20  # None: sized in pages (--quick's tiny documents)
    w6_host_bytes: int | None = 512 << 20
    notes: tuple[str, ...] = ()


QUICK = BenchPlan(
    quick=True,
    repeats=1,
    prefill_lengths=(128, 512),
    decode_prompt=128,
    decode_tokens=16,
    bandwidth_bytes=128 << 20,
    doc_tokens=256,
    rounds=1,
    answer_tokens=8,
    sweep_lengths=(256, 512),
    sweep_answer_tokens=2,
    w2_sessions=8,
    w2_tokens=8,
    w3_ingest_tokens=768,
    w3_baseline_tokens=16,
    w7_doc_tokens=256,
    w7_pause_s=0.5,
    w7_short_pause_s=0.1,
    w7_answer_tokens=4,
    w7_window_tokens=24,
    w5_doc_tokens=600,  # two full pages of 256 tokens: the disk tier has something to hold
    w6_sessions=6,
    w6_doc_tokens=600,
    w6_rounds=1,
    w6_device_bytes=None,
    w6_host_bytes=None,
)


def make_plan(*, quick: bool, repeats: int | None, context_length: int) -> BenchPlan:
    """The plan for this model: sizes that do not fit its context are dropped or cut, noted."""
    plan = QUICK if quick else BenchPlan()
    if repeats is not None:
        plan = replace(plan, repeats=repeats)
    room = context_length - 256  # a prompt must leave room for its answer and a follow-up
    notes: list[str] = []
    lengths = tuple(n for n in plan.prefill_lengths if n <= context_length - 1)
    sweep = tuple(n for n in plan.sweep_lengths if n <= room)
    if lengths != plan.prefill_lengths or sweep != plan.sweep_lengths:
        notes.append(f"lengths beyond the model's context ({context_length}) were dropped")
    doc = min(plan.doc_tokens, room - plan.rounds * (plan.answer_tokens + 48))
    ingest = min(plan.w3_ingest_tokens, room)
    pasted = min(plan.w7_doc_tokens, room - 64)  # the question and the template around it
    w5_doc = min(plan.w5_doc_tokens, room - 2 * (plan.answer_tokens + 48))
    w6_doc = min(plan.w6_doc_tokens, room - plan.w6_rounds * (plan.answer_tokens + 48))
    cut = (plan.w5_doc_tokens, plan.w6_doc_tokens, plan.w7_doc_tokens) != (w5_doc, w6_doc, pasted)
    if doc != plan.doc_tokens or ingest != plan.w3_ingest_tokens or cut:
        notes.append(f"documents were cut to fit the model's context ({context_length})")
    return replace(
        plan,
        prefill_lengths=lengths or (min(128, context_length - 1),),
        decode_prompt=min(plan.decode_prompt, room),
        sweep_lengths=sweep or (max(64, room // 2),),
        doc_tokens=max(32, doc),
        w3_ingest_tokens=max(32, ingest),
        w7_doc_tokens=max(32, pasted),
        w5_doc_tokens=max(32, w5_doc),
        w6_doc_tokens=max(32, w6_doc),
        notes=tuple(notes),
    )


@dataclass
class BenchContext:
    """What the workloads need: the model, the engines, the plan, a progress line."""

    model: object  # kvchat.model.loader.LoadedModel
    plan: BenchPlan
    kvchat: KvchatPeer
    chat_peers: dict[str, ChatPeer] = field(default_factory=dict)
    speed_peers: dict[str, SpeedPeer] = field(default_factory=dict)
    # kvchat with its weights dense in the compute dtype, when its default is quantized:
    # the same-dtype comparison with transformers (speed only)
    kvchat_variants: dict[str, KvchatPeer] = field(default_factory=dict)
    # kvchat with its disk tier on (a fresh folder per engine): sweep and W2 run it beside
    # kvchat to show the tier costs nothing there; W5 and W6 are about it
    kvchat_disk: KvchatPeer | None = None
    scratch: Path | None = None  # a folder on the cache's disk for W5's files
    progress: Callable[[str], None] = lambda _m: None
    model_load: ModelLoad | None = None  # how `model` was loaded: W5's restart loads it again


# ---- running and summarizing ---------------------------------------------------------------


def _repeat(ctx: BenchContext, workload: str, runs: dict[str, Callable[[], dict]]) -> dict:
    """Run each engine's function `repeats` times, interleaved; keep errors, not tracebacks."""
    out: dict = {"engines": {}, "not_applicable": {}, "errors": {}}
    live = dict(runs)
    for r in range(ctx.plan.repeats):
        for name, fn in list(live.items()):
            ctx.progress(f"{workload}: {name}, run {r + 1} of {ctx.plan.repeats}...")
            start = time.perf_counter()
            try:
                result = fn()
            except NotApplicable as exc:
                out["not_applicable"][name] = str(exc)
                del live[name]
                continue
            except Exception as exc:  # one engine failing must not lose the others' numbers
                ctx.progress("".join(traceback.format_exception(exc)).rstrip())
                out["errors"][name] = f"{type(exc).__name__}: {exc}"
                del live[name]
                continue
            result["run_s"] = time.perf_counter() - start
            out["engines"].setdefault(name, {"runs": []})["runs"].append(result)
    for entry in out["engines"].values():
        entry["median"] = median_of_runs(entry["runs"])
    return out


def median_of_runs(runs: list) -> object:
    """Medians of every number across runs, recursively (lists element by element)."""
    first = runs[0]
    if isinstance(first, bool) or not isinstance(first, int | float | dict | list):
        return first
    if isinstance(first, int | float):
        return statistics.median(runs)
    if isinstance(first, dict):
        keys = [k for k in first if all(isinstance(r, dict) and k in r for r in runs)]
        return {k: median_of_runs([r[k] for r in runs]) for k in keys}
    if all(isinstance(r, list) and len(r) == len(first) for r in runs):
        return [median_of_runs([r[i] for r in runs]) for i in range(len(first))]
    return first


# ---- speed -----------------------------------------------------------------------------------


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
    out = _repeat(ctx, "speed", {name: one(peer) for name, peer in peers.items()})
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


# ---- W1: switching between sessions with long documents ----------------------------------


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


def _w1_capacity(ctx: BenchContext, openers: list[str]) -> int:
    plan = ctx.plan
    per_turn = plan.answer_tokens + 48
    return sum(
        len(docs.user_prompt_ids(ctx.model, o)) + (plan.rounds + 1) * per_turn for o in openers
    )


def _chat_run(make_chat: Callable[[], ChatEngine], body: Callable[[ChatEngine], dict]):
    def run() -> dict:
        chat = make_chat()
        try:
            return body(chat)
        finally:
            chat.close()

    return run


def run_w1(ctx: BenchContext) -> dict:
    plan = ctx.plan
    openers = docs.w1_openers(ctx.model.tokenizer, plan.doc_tokens)
    capacity = _w1_capacity(ctx, openers)
    engines = {
        name: _chat_run(lambda p=peer: p.chat(capacity), lambda c: w1_once(c, openers, plan))
        for name, peer in [("kvchat", ctx.kvchat), *ctx.chat_peers.items()]
    }
    out = _repeat(ctx, "W1", engines)
    out["documents"] = {"files": list(docs.W1_FILES), "tokens_each": plan.doc_tokens}
    out["rounds"] = plan.rounds
    out["answer_tokens"] = plan.answer_tokens
    base = out["engines"].get("kvchat", {}).get("median", {}).get("total_s")
    for entry in out["engines"].values():
        if base:
            entry["total_vs_kvchat"] = entry["median"]["total_s"] / base
    return out


# ---- the switch-cost sweep ---------------------------------------------------------------


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
        for name, peer in [("kvchat", ctx.kvchat), *_disk_variant(ctx), *ctx.chat_peers.items()]
    }
    out = _repeat(ctx, "sweep", engines)
    out["lengths"] = list(ctx.plan.sweep_lengths)
    return out


def _disk_variant(ctx: BenchContext) -> list[tuple[str, KvchatPeer]]:
    return [] if ctx.kvchat_disk is None else [(DISK_NAME, ctx.kvchat_disk)]


# ---- W2: concurrency -------------------------------------------------------------------------


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

    engines = {"kvchat": one(ctx.kvchat)} | {n: one(p) for n, p in _disk_variant(ctx)}
    engines |= {n: one(p) for n, p in ctx.speed_peers.items()}
    engines |= {n: sessions(p) for n, p in ctx.chat_peers.items() if hasattr(p, "concurrent")}
    out = _repeat(ctx, "W2", engines)
    out["sessions"] = plan.w2_sessions
    out["tokens_each"] = plan.w2_tokens
    return out


# ---- W3: interference of a long ingest with running streams -------------------------------


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

    out = _repeat(ctx, "W3", {"kvchat": run})
    for name in [*ctx.chat_peers, *ctx.speed_peers]:
        out["not_applicable"][name] = SERIAL_ONLY
    out["streams"] = len(streams)
    return out


# ---- W4: a device cache smaller than the working set --------------------------------------


def run_w4(ctx: BenchContext) -> dict:
    """W1 with the device cache at half its working set: host tier on, off; all on device."""
    plan, peer = ctx.plan, ctx.kvchat
    openers = docs.w1_openers(ctx.model.tokenizer, plan.doc_tokens)
    capacity = _w1_capacity(ctx, openers)
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
                "prompt_tokens": stats.prompt_tokens,
                "cached_device_tokens": stats.cached_tokens.device,
                "cached_host_tokens": stats.cached_tokens.host,
                "prefilled_tokens": stats.prefilled_tokens,
                "recomputed_tokens": stats.recomputed_tokens,
                "device_pages": stats.pages["device"].capacity,
                "host_pages": stats.pages["host"].capacity,
                "evictions": {
                    "device_to_host": stats.evictions.device_to_host,
                    "host_dropped": stats.evictions.host_dropped,
                    "device_dropped": stats.evictions.device_dropped,
                },
            }

        return _chat_run(
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
    out = _repeat(ctx, "W4", engines)
    out.update(sizing)
    out["page_size"] = peer.page_size
    for name in ctx.chat_peers:
        out["not_applicable"][name] = W4_ONLY
    return out


# ---- W5: a restart ---------------------------------------------------------------------


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


def _scratch(ctx: BenchContext) -> Path:
    root = ctx.scratch or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="w5-", dir=root))


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
    work = _scratch(ctx)
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
    work = _scratch(ctx)
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
    out = _repeat(ctx, "W5", engines)
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


# ---- W6: more conversations than the RAM tiers hold -----------------------------------------


def run_w6(ctx: BenchContext) -> dict:
    """W1's pattern over 16 different documents with small device and host tiers: follow-up
    TTFT (median, p95) and total time with the disk tier and without."""
    from kvchat.bench.peers.kvchat import percentile

    plan, peer = ctx.plan, ctx.kvchat
    files = docs.W6_FILES[: plan.w6_sessions]
    openers = docs.w1_openers(ctx.model.tokenizer, plan.w6_doc_tokens, files)
    w6_plan = replace(plan, rounds=plan.w6_rounds)
    capacity = _w1_capacity(ctx, openers)
    page_bytes = peer.page_bytes()
    per_session = math.ceil(capacity / len(openers) / peer.page_size) + 1
    # --quick: RAM tiers for about three of the conversations, so most must come from disk
    device = plan.w6_device_bytes or (2 * per_session + 2) * page_bytes
    host = plan.w6_host_bytes or per_session * page_bytes

    def configured(disk: bool) -> Callable[[], dict]:
        def run() -> dict:
            work = _scratch(ctx) if disk else None
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
                    "device": stats.cached_tokens.device,
                    "host": stats.cached_tokens.host,
                    "disk": stats.cached_tokens.disk,
                },
                "evictions": {
                    "device_to_host": stats.evictions.device_to_host,
                    "host_dropped": stats.evictions.host_dropped,
                    "host_to_disk": stats.evictions.host_to_disk,
                },
            }

        return run

    out = _repeat(
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


WORKLOADS: dict[str, Callable[[BenchContext], dict]] = {
    "speed": run_speed,
    "W1": run_w1,
    "sweep": run_sweep,
    "W2": run_w2,
    "W3": run_w3,
    "W4": run_w4,
    "W7": run_w7,
    "W5": run_w5,
    "W6": run_w6,
}
