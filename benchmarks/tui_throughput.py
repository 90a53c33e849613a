"""Engine throughput under the TUI vs headless (target: at least 90%).

Eight sessions each generate 128 tokens at once on the default model, first through
the session layer alone (what `kvchat run` does), then inside the real `KvchatApp`
(Textual, headless via `run_test`, the transcript of one session visible and
streaming, meters refreshing). The figure is aggregate generated tokens per second
from the first token to the last; the same engine settings both times. Under the
TUI it also prints the UI thread's share of a core over that window (its CPU time
per second), the figure `cpu_contention.py` relates to the engine's loss.

    python benchmarks/tui_throughput.py [--rounds 3] [--markdown kvchat|stock]

`--markdown stock` streams each reply through Textual's stock `Markdown.get_stream()`
(`MarkdownStream`, as oterm does) instead of kvchat's `StreamingMarkdown`, which patches
the growing block in place: run both, interleaved by hand, to see what the in-place
patching is worth on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

from textual.await_complete import AwaitComplete
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import SamplingParams
from kvchat.model.loader import load_model
from kvchat.native import build
from kvchat.testing.tui import new_sessions, ready
from kvchat.tui import transcript
from kvchat.tui.app import KvchatApp
from kvchat.tui.backend import TuiBackend

SESSIONS, TOKENS = 8, 128
GREEDY = SamplingParams(temperature=0.0)
CONFIG = EngineConfig(device_cache_bytes=512 << 20, host_cache_bytes=0)


class StockStreamingMarkdown(Markdown):
    """A reply body streamed through Textual's stock `MarkdownStream` (`--markdown stock`).

    The same interface as `StreamingMarkdown` (`write`, `end_stream`, `update`), so the
    transcript's `MessageBlock` uses it unchanged. The stream is stopped before a final
    `update`, so its last fragments never land after the final text.
    """

    def __init__(self, markdown: str | None = None, *, classes: str | None = None) -> None:
        super().__init__(markdown, classes=classes)
        self._stream: MarkdownStream | None = None
        self._stopping: asyncio.Task | None = None

    async def write(self, markdown: str) -> None:
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(markdown)

    def end_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._stopping = asyncio.ensure_future(stream.stop())

    def update(self, markdown: str) -> AwaitComplete:
        return AwaitComplete(self._stop_then_update(markdown))

    async def _stop_then_update(self, markdown: str) -> None:
        self.end_stream()
        stopping, self._stopping = self._stopping, None
        if stopping is not None:
            await stopping
        await super().update(markdown)


def launch() -> Engine:
    return Engine.launch(lambda: load_model(None, dtype="bfloat16"), CONFIG)


def rate(times: list[tuple[float, int]]) -> float:
    """Tokens per second from the first delta to the last (the first delta's tokens excluded)."""
    first = min(t for t, _ in times)
    last = max(t for t, _ in times)
    return (sum(n for _, n in times) - times[0][1]) / (last - first)


def recorder(times: list[tuple[float, int]]):
    def on_event(event) -> None:
        if type(event).__name__ == "ReplyDelta":
            times.append((time.perf_counter(), len(event.token_ids)))

    return on_event


def start_all(service: SessionService, ids: list[str]) -> None:
    for i, sid in enumerate(ids):
        service.say(sid, f"Tell me a long story number {i}.", sampling=GREEDY,
                    max_tokens=TOKENS, ignore_eos=True)  # fmt: skip


def headless() -> float:
    engine = launch()
    service = SessionService(engine, engine.model.renderer, Store.in_memory(),
                             stop_token_ids=engine.model.tokenizer.stop_token_ids)  # fmt: skip
    times: list[tuple[float, int]] = []
    service.subscribe(recorder(times))
    ids = [service.create_session(f"s{i}") for i in range(SESSIONS)]
    start_all(service, ids)
    assert service.wait_idle(None, timeout=600)
    service.close()
    engine.close()
    return rate(times)


async def under_tui() -> tuple[float, float]:
    """(aggregate tokens/s, the UI thread's share of a core from the first token to the last)"""

    def factory(report):
        engine = launch()
        model = engine.model
        return TuiBackend(
            chat=ChatBackend(engine, model.renderer, frozenset(model.tokenizer.stop_token_ids)),
            default_sampling=GREEDY,
            default_max_tokens=TOKENS,
            description="bench",
            close=engine.close,
        )

    app = KvchatApp(factory, store_factory=Store.in_memory)
    times: list[tuple[float, int]] = []
    ui_clock = time.pthread_getcpuclockid(threading.get_ident())  # this (the UI) thread's
    ui_cpu: list[tuple[float, float]] = []  # (wall, UI thread CPU) at the first and last delta
    async with app.run_test(size=(160, 45)) as pilot:
        await ready(pilot, app)
        app.service.subscribe(recorder(times))
        ids = await new_sessions(pilot, app, SESSIONS)
        # Waiting for the replies must not cost the UI thread anything a user's session
        # would not: polling `pilot.pause()` walks every message pump for idleness, ~7% of
        # the UI thread while the replies stream. The recorder (on the service's thread)
        # wakes this coroutine once, when the last token has arrived.
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        total = SESSIONS * TOKENS

        received = 0

        def on_event(event) -> None:
            nonlocal received
            if type(event).__name__ == "ReplyDelta":
                received += len(event.token_ids)
                if not ui_cpu or received >= total:
                    ui_cpu.append((time.perf_counter(), time.clock_gettime(ui_clock)))
                if received >= total:
                    loop.call_soon_threadsafe(done.set)

        app.service.subscribe(on_event)
        start_all(app.service, ids)
        await asyncio.wait_for(done.wait(), 600)
        (wall0, cpu0), (wall1, cpu1) = ui_cpu[0], ui_cpu[-1]
        return rate(times), (cpu1 - cpu0) / (wall1 - wall0)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--markdown",
        choices=("kvchat", "stock"),
        default="kvchat",
        help="how the TUI streams a reply's Markdown (default: kvchat's StreamingMarkdown)",
    )
    args = parser.parse_args()
    if args.markdown == "stock":
        transcript.StreamingMarkdown = StockStreamingMarkdown  # what MessageBlock builds
    build.request(wait=True)  # on a fresh install the kernel compiles first, not mid-run
    runs: dict[str, list[float]] = {"headless": [], "TUI": []}
    ui_shares: list[float] = []

    def tui() -> float:
        tokens_per_s, ui_share = asyncio.run(under_tui())
        ui_shares.append(ui_share)
        return tokens_per_s

    measure = {"headless": headless, "TUI": tui}
    # One run of each is one sample of a machine whose speed drifts by tens of percent
    # within minutes: the two are interleaved, their order reversed every round, and
    # compared by medians.
    for r in range(args.rounds):
        order = ("headless", "TUI") if r % 2 == 0 else ("TUI", "headless")
        for name in order:
            runs[name].append(measure[name]())
        print(f"round {r + 1}: headless {runs['headless'][-1]:.1f} tok/s, "
              f"under the TUI {runs['TUI'][-1]:.1f} tok/s "
              f"(UI thread {ui_shares[-1]:.3f} of a core)", flush=True)  # fmt: skip
    a, b = statistics.median(runs["headless"]), statistics.median(runs["TUI"])
    print(f"markdown: {args.markdown}; medians of {args.rounds}: headless {a:.1f} tok/s; "
          f"under the TUI {b:.1f} tok/s; "
          f"ratio {b / a:.3f}; UI thread {statistics.median(ui_shares):.3f} of a core "
          "while the replies stream")  # fmt: skip


if __name__ == "__main__":
    main()
