"""What another thread's CPU costs the engine: the ceiling on the TUI's throughput.

The TUI's UI thread spends about 12% of a core while eight replies stream (see
`tui_throughput.py`, which prints it). This script asks what *any* thread spending
that much costs the engine, with no Textual involved: the load of `tui_throughput.py`
(eight sessions, 128 tokens each, headless) runs while a side thread works in bursts
at 20 Hz, the TUI's flush rate, and sleeps in between. The burst is either Python
(holding the GIL, like the UI's work) or C that releases the GIL (hashing a buffer),
optionally at a lower scheduling priority (`nice`). Each variant reports the engine's
tokens/s against the same load with no side thread, the side thread's share of a core,
and its slowest burst (what a frame would wait).

    python benchmarks/experiments/cpu_contention.py [--rounds 3] [--busy-ms 6]

The GIL switch interval is the app's (`GIL_SWITCH_INTERVAL_S`) throughout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tui_throughput

import tui_throughput

from kvchat.native import build
from kvchat.tui.app import GIL_SWITCH_INTERVAL_S
from kvchat.tui.frame_pump import FLUSH_HZ

_BUFFER = b"x" * (1 << 20)  # hashlib releases the GIL for inputs over 2 KiB


@dataclass(frozen=True)
class Variant:
    """A side thread's kind of work (python / c / none) and its nice value."""

    work: str
    nice: int = 0

    @property
    def name(self) -> str:
        return self.work + (f" nice {self.nice}" if self.nice else "")


@dataclass(frozen=True)
class SideThreadReport:
    cpu_share: float  # CPU seconds of the side thread per second of wall time
    worst_burst_s: float  # the longest wall time one burst took


class SideThread:
    """Work `busy_s` then sleep for the rest of each `period_s`, until stopped."""

    def __init__(self, variant: Variant, busy_s: float, period_s: float) -> None:
        self.variant, self.busy_s, self.period_s = variant, busy_s, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.report: SideThreadReport | None = None

    def __enter__(self) -> SideThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _burst(self) -> None:
        """`busy_s` of the variant's work (measured by the thread's CPU clock: a burst
        that gets less of a core takes longer, as a frame would)."""
        end = time.thread_time() + self.busy_s
        while time.thread_time() < end:
            if self.variant.work == "python":
                sum(range(200))
            else:
                hashlib.sha256(_BUFFER).digest()

    def _run(self) -> None:
        if self.variant.nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.variant.nice)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        worst = 0.0
        while not self._stop.is_set():
            start = time.perf_counter()
            self._burst()
            took = time.perf_counter() - start
            worst = max(worst, took)
            self._stop.wait(max(0.0, self.period_s - took))
        wall = time.perf_counter() - wall0
        self.report = SideThreadReport((time.thread_time() - cpu0) / wall, worst)


def measure(variant: Variant, busy_s: float) -> tuple[float, SideThreadReport | None]:
    if variant.work == "none":
        return tui_throughput.headless(), None
    with SideThread(variant, busy_s, 1 / FLUSH_HZ) as side:
        rate = tui_throughput.headless()
    return rate, side.report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-ms", type=float, default=6.0, help="CPU time per burst")
    parser.add_argument(
        "--variants",
        default="none,python,c,python:19",
        help="comma-separated work[:nice] (work: none, python, c)",
    )
    args = parser.parse_args()
    variants = []
    for spec in args.variants.split(","):
        work, _, nice = spec.partition(":")
        if work not in ("none", "python", "c"):
            parser.error(f"unknown work {work!r}: use none, python or c")
        variants.append(Variant(work, int(nice or 0)))
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    build.request(wait=True)
    rates: dict[str, list[float]] = {v.name: [] for v in variants}
    reports: dict[str, list[SideThreadReport]] = {v.name: [] for v in variants}
    for r in range(args.rounds):
        # interleaved, the order rotated each round: the machine's speed drifts
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            rate, report = measure(variant, args.busy_ms / 1000)
            rates[variant.name].append(rate)
            if report is not None:
                reports[variant.name].append(report)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()),
              flush=True)  # fmt: skip
    base = statistics.median(rates[variants[0].name])
    print(f"\nside thread: {args.busy_ms:g} ms of CPU per burst at {FLUSH_HZ} Hz; "
          f"medians of {args.rounds}; ratio against {variants[0].name!r}")  # fmt: skip
    print(f"{'variant':14s} {'tok/s':>7s} {'ratio':>6s} {'core share':>10s} {'worst burst':>11s}")
    for variant in variants:
        rate = statistics.median(rates[variant.name])
        side = reports[variant.name]
        share = f"{statistics.median(s.cpu_share for s in side):.3f}" if side else "-"
        worst = f"{max(s.worst_burst_s for s in side) * 1000:.1f} ms" if side else "-"
        print(f"{variant.name:14s} {rate:7.1f} {rate / base:6.3f} {share:>10s} {worst:>11s}")


if __name__ == "__main__":
    main()
