"""Soak: many turns over many sessions through small caches, checking everything as it goes.

Headless (the session service over the engine, no UI): `--sessions` sessions take
`--turns` turns, `--concurrency` replies at a time, through a device cache and a host
tier small enough that pages are evicted, dropped and requests preempted. What it checks,
and exits 1 on the first failure of:

- the page table's invariants (`validate()`) after every engine step, on the engine's
  own thread (a `ValidatingEngine`: the engine's debug mode);
- every reply ends `stop` or `length` (never `error`), and its counters add up:
  prompt = cached (device + host + disk) + prefilled;
- the engine's cumulative counters add up the same way at the end, and evictions and
  preemptions did happen (else the caches were not small enough to test anything).

What it measures: the process's resident memory (RSS) sampled every `--sample-every`
turns (the growth from turn 100 to the last turn is the leak figure: under 5% is the
goal; the growth over the second half tells a cache that fills up and stops from a
leak, which grows there too) and the wall time. Timing is only meaningful on an
otherwise idle machine. The KV stores' memory is committed before the first turn
(`fault_in_caches`), so that their first filling is not counted as growth.

    python benchmarks/soak.py                      # 1,000 turns over 20 sessions
    python benchmarks/soak.py --turns 60 --sessions 6 --model PATH   # a quick check
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.chat.events import ChatEvent, ReplyFinished, SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import SamplingParams
from kvchat.engine.tiers.kv_store import fault_in
from kvchat.model.loader import load_model
from kvchat.units import parse_size

TOPICS = [
    "the moon", "rivers", "bread", "chess", "volcanoes", "bees", "glass", "trains",
    "clouds", "salt", "whales", "maps", "copper", "tea", "owls", "bridges",
]  # fmt: skip


class ValidatingEngine(Engine):
    """The engine's debug mode: the page table is validated after every step."""

    steps_validated = 0

    def step(self) -> bool:
        worked = super().step()
        self.validate_cache()  # raises on a broken invariant: the step loop fails the requests
        ValidatingEngine.steps_validated += 1
        return worked


def fault_in_caches(engine: Engine) -> None:
    """Commit the KV stores' memory before the first turn, so that filling them is not
    counted as growth.

    The device and host stores are fixed allocations that the OS maps page by page as
    they are first written: unfaulted, the soak's first few hundred turns would show
    up to their whole size (160 MiB at the defaults) as "growth". An idle kvchat
    commits its device store within seconds of launch anyway (idle housekeeping). No
    request has run yet, so nothing else writes the stores meanwhile (`fault_in` keeps
    their bytes).
    """
    stores = [engine.store, engine.host_store]
    for part in (t for store in stores if store is not None for t in store.parts):
        fault_in(part)


def rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Soak:
    """What the run saw; filled from the service's worker thread under `lock`."""

    turns: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: int = 0
    failures: list[str] = field(default_factory=list)
    by_reason: dict[str, int] = field(default_factory=dict)
    rss: dict[int, int] = field(default_factory=dict)  # turns finished -> RSS bytes
    done: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.done = threading.Condition(self.lock)

    def on_event(self, event: ChatEvent) -> None:
        with self.lock:
            if isinstance(event, SessionFailed):
                self.failures.append(f"session failed: {event.message}")
            elif isinstance(event, ReplyFinished):
                s = event.stats
                self.finished += 1
                self.by_reason[s.finish_reason] = self.by_reason.get(s.finish_reason, 0) + 1
                cached = s.cached_tokens.total
                if s.finish_reason not in ("stop", "length"):
                    self.failures.append(f"turn {self.finished}: {s.finish_reason}: {s.error}")
                elif s.prompt_tokens != cached + s.prefilled_tokens:
                    self.failures.append(
                        f"turn {self.finished}: prompt {s.prompt_tokens} != cached {cached} "
                        f"+ prefilled {s.prefilled_tokens}"
                    )
            self.done.notify_all()


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    config = EngineConfig(
        page_size=args.page_size,
        device_cache_bytes=parse_size(args.device_cache),
        host_cache_bytes=parse_size(args.host_cache),
    )
    started = time.perf_counter()
    engine = ValidatingEngine.launch(
        lambda: load_model(args.model, dtype=args.dtype, device="cpu"), config
    )
    model = engine.model
    fault_in_caches(engine)
    service = SessionService(
        engine,
        model.renderer,
        Store.in_memory(),
        stop_token_ids=frozenset(model.tokenizer.stop_token_ids),
        default_sampling=SamplingParams(temperature=0.0, top_p=1.0),
        default_max_tokens=args.max_tokens,
    )
    soak = Soak(args.turns)
    service.subscribe(soak.on_event)
    sessions = [service.create_session(f"soak {i + 1}") for i in range(args.sessions)]
    loaded = time.perf_counter()
    try:
        for turn in range(1, args.turns + 1):
            with soak.lock:  # at most `concurrency` replies at once
                while turn - 1 - soak.finished >= args.concurrency and not soak.failures:
                    soak.done.wait(timeout=1.0)
                if soak.failures:
                    break
            # an idle session when there is one (a say to a busy one waits for its reply)
            idle = [s for s in sessions if service.session(s).state == "idle"]
            session = rng.choice(idle or sessions)
            topic = rng.choice(TOPICS)
            service.say(session, f"Turn {turn}: say one short thing about {topic}.")
            if turn % args.sample_every == 0 or turn == 100:
                soak.rss[turn] = rss_bytes()
            if turn % 50 == 0:
                rss_mib = rss_bytes() / 2**20
                progress = f"turn {turn}/{args.turns}: {soak.finished} replies, {rss_mib:.0f} MiB"
                print(progress, file=sys.stderr, flush=True)
        service.wait_idle()
        soak.rss[args.turns] = rss_bytes()
        stats = engine.stats()
    finally:
        service.close()
        engine.close()
    wall = time.perf_counter() - loaded

    counters = stats.cache
    cached = counters.cached_tokens.total
    if counters.prompt_tokens != cached + counters.prefilled_tokens:
        soak.failures.append(
            f"engine: prompt {counters.prompt_tokens} != cached {cached} + prefilled "
            f"{counters.prefilled_tokens}"
        )
    evictions = counters.evictions
    evicted = evictions.device_to_host + evictions.host_dropped + evictions.device_dropped
    if not soak.failures and soak.finished < args.turns:
        soak.failures.append(f"only {soak.finished} of {args.turns} turns finished")
    if evicted == 0 or stats.preemptions == 0:
        soak.failures.append(
            f"the caches were not small enough: {evicted} evictions, {stats.preemptions} "
            "preemptions (lower --device-cache / --host-cache)"
        )
    first = soak.rss.get(100) or soak.rss[min(soak.rss)]
    last = soak.rss[args.turns]
    # the second half alone: caches that fill up and stop (compiled kernels, a peak
    # step's buffers) grow the first figure; a leak grows this one too
    half_turn = min(soak.rss, key=lambda t: abs(t - args.turns / 2))
    half = soak.rss[half_turn]
    result = {
        "turns": soak.finished,
        "sessions": args.sessions,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "device_cache": args.device_cache,
        "host_cache": args.host_cache,
        "page_size": args.page_size,
        "model": model.name,
        "steps_validated": ValidatingEngine.steps_validated,
        "finish_reasons": soak.by_reason,
        "evictions": {
            "device_to_host": evictions.device_to_host,
            "host_dropped": evictions.host_dropped,
            "device_dropped": evictions.device_dropped,
        },
        "preemptions": stats.preemptions,
        "recomputed_tokens": counters.recomputed_tokens,
        "hit_rate": stats.hit_rate,
        "rss_mib": {str(k): round(v / 2**20, 1) for k, v in sorted(soak.rss.items())},
        "rss_growth_from_turn": min(100, args.turns) if 100 in soak.rss else min(soak.rss),
        "rss_growth": (last - first) / first if first else None,
        "rss_growth_second_half_from_turn": half_turn,
        "rss_growth_second_half": (last - half) / half if half else None,
        "load_s": round(loaded - started, 1),
        "wall_s": round(wall, 1),
        "failures": soak.failures,
    }
    print(json.dumps(result, indent=2))
    growth, tail = result["rss_growth"], result["rss_growth_second_half"]

    def change(before: int, after: int, ratio: float | None) -> str:
        shown = "n/a" if ratio is None else f"{ratio:+.1%}"
        return f"{before / 2**20:.0f} -> {after / 2**20:.0f} MiB ({shown})"

    print(
        f"\n| turns | sessions | validated steps | evictions | preemptions | hit rate "
        f"| RSS turn {result['rss_growth_from_turn']} -> {soak.finished} "
        f"| RSS turn {half_turn} -> {soak.finished} | wall |\n"
        f"|---|---|---|---|---|---|---|---|---|\n"
        f"| {soak.finished} | {args.sessions} | {ValidatingEngine.steps_validated:,} | "
        f"{evicted:,} | {stats.preemptions:,} | {stats.hit_rate:.0%} | "
        f"{change(first, last, growth)} | {change(half, last, tail)} | {wall:.0f} s |"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if soak.failures:
        print("FAILED:\n  " + "\n  ".join(soak.failures[:20]), file=sys.stderr)
        return 1
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: kvchat's default model")
    p.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: the hardware's)")
    p.add_argument("--turns", type=int, default=1000)
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=4, help="replies generating at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device-cache", default="96MiB")
    p.add_argument("--host-cache", default="64MiB")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--sample-every", type=int, default=50, help="RSS sample interval, turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON result here")
    args = p.parse_args()
    if args.concurrency > args.sessions:
        p.error("--concurrency cannot exceed --sessions")
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
