"""Repaint latency of switching sessions while others stream (target: under 100 ms).

Runs the real `KvchatApp` headless (Textual's Pilot) over the fake engine: 8
sessions stream long replies (a thread advances the engine one step every
20 ms, so each session gets ~50 tokens/s), and the script switches sessions
with alt+down many times. The latency of one switch is from the key event
(`simulate_key`, the path a terminal's key takes) to the first screen update
(the compositor's `_display`) after the transcript holds the chosen session
with its Markdown parsed, i.e. the frame a terminal would paint. Pilot's
`pause()` is not used for timing: it waits for the whole process to go idle,
which never happens quickly while eight streams run. Prints median and p95.

The real engine freezes the objects alive at its launch out of the garbage collector's
walks (`freeze_long_lived_objects`, during start-up, before the sessions are listed);
the fake engine's start does the same here, or every full collection would walk the
whole start-up heap (75,000 objects: 15-90 ms pauses, the slowest switches).

    python benchmarks/tui_switch_latency.py [--switches 60] [--sessions 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.engine.engine import freeze_long_lived_objects
from kvchat.testing.tui import fake_app, ready, wait_until


async def measure(sessions: int, switches: int) -> list[float]:
    app, engine = fake_app(manual=True, tokens_per_reply=100_000)
    load_backend = app.backend_factory

    def launch_like_the_real_engine(progress):
        backend = load_backend(progress)
        freeze_long_lived_objects()
        return backend

    app.backend_factory = launch_like_the_real_engine
    stop = threading.Event()

    def pump() -> None:  # the "engine": one step (a token per live reply) every 20 ms
        while not stop.wait(0.02):
            engine.advance(1)

    async with app.run_test(size=(150, 45)) as pilot:
        await ready(pilot, app)
        for i in range(sessions):
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda n=i + 1: len(app.chat.sidebar.order) == n)
            app.service.say(
                app.chat.current, f"session {i}: a long story please", max_tokens=100_000
            )
        threading.Thread(target=pump, daemon=True).start()
        await wait_until(pilot, lambda: all(v.state == "decoding" for v in app.chat.views.values()))
        for _ in range(20):  # some text in every session first
            await pilot.pause(0.05)
        frames: list[float] = []
        display = app._display

        def timed_display(screen, renderable) -> None:
            if renderable is not None:
                frames.append(time.perf_counter())
            display(screen, renderable)

        app._display = timed_display  # type: ignore[method-assign]

        def rendered(target: str) -> bool:
            blocks = app.chat.transcript.blocks()
            return (
                app.chat.transcript.session_id == target
                and bool(blocks)
                and all(b.body.children or not b.body.source for b in blocks)
            )

        latencies: list[float] = []
        for _ in range(switches):
            order = app.chat.sidebar.order
            target = order[(order.index(app.chat.current) + 1) % len(order)]
            t0 = time.perf_counter()
            app.simulate_key("alt+down")
            deadline = t0 + 5
            while not rendered(target) and time.perf_counter() < deadline:
                await asyncio.sleep(0.001)
            ready_at = time.perf_counter()
            while not (frames and frames[-1] >= ready_at) and time.perf_counter() < deadline:
                await asyncio.sleep(0.001)
            latencies.append((frames[-1] - t0) * 1000)
            await asyncio.sleep(0.1)  # let the streams flow between switches
        stop.set()
        for session_id in app.chat.sidebar.order:
            app.service.stop(session_id)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=60)
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args()
    latencies = asyncio.run(measure(args.sessions, args.switches))
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    print(
        f"switch repaint latency with {args.sessions} sessions streaming, {len(latencies)} "
        f"switches: median {statistics.median(latencies):.1f} ms, p95 {p95:.1f} ms, "
        f"max {ordered[-1]:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
