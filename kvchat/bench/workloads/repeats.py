"""Running one workload on every engine, repeated and interleaved, and taking medians.

Repeats are interleaved (repeat 1 of every engine, then repeat 2...), so a noisy
stretch of the machine falls on all engines alike. Every workload returns the same
shape: `{"engines": {name: {"runs": [...], "median": {...}}}, "not_applicable": {name:
reason}, "errors": {name: message}, ...}`, plus figures of its own; where the engines'
speed is compared (speed, W1, W2), each engine's entry also has its process's peak
memory (`"peak_rss"`, `record_peaks`).
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Mapping

from kvchat.bench.peak_memory import engine_peak
from kvchat.bench.peers.base import ChatEngine, NotApplicable
from kvchat.bench.workloads.context import BenchContext


def repeat_interleaved(
    ctx: BenchContext, workload: str, runs: dict[str, Callable[[], dict]]
) -> dict:
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


def record_peaks(out: dict, peers: Mapping[str, object]) -> None:
    """Each engine's peak resident memory beside its figures, read when the workload ends
    (`peak_memory`): a high-water mark of the run so far, not of this workload alone."""
    for name, entry in out["engines"].items():
        peer = peers.get(name)
        peak = engine_peak(peer) if peer is not None else None
        if peak is not None:
            entry["peak_rss"] = peak.to_json()


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


def chat_run(
    make_chat: Callable[[], ChatEngine], body: Callable[[ChatEngine], dict]
) -> Callable[[], dict]:
    """One repeat on a fresh chat engine, closed afterwards whatever happens."""

    def run() -> dict:
        chat = make_chat()
        try:
            return body(chat)
        finally:
            chat.close()

    return run
