"""`FramePacer`: which ticks of the UI's timer draw a frame, so repaints keep to a CPU budget.

Why: on a small machine the model's matmuls use every core, and whatever the UI
thread runs takes a core from them for that long: a generation step that loses
a core to a screen update waits for it, so the engine's tokens per second fall by
about the share of a core the UI spends (measured with `benchmarks/tui_throughput.py`:
the UI thread at 15% of a core cost 8 streaming sessions 12-15% of their rate; with
the app up but drawing nothing, 3.5% cost about 4%). A frame (the visible reply's
new text, changed sidebar rows, the meters, and the screen update they share) costs
a few milliseconds of Textual, more when text wraps onto a new line or a list grows
an item and the screen is laid out again; at a fixed 20 Hz that is 10-15% of a core.

So the frame rate follows the frames' cost: the UI thread's CPU time since the
previous frame (everything it did, screen updates included) divided by `budget`
is the time until the next, between the timer's own period (the fastest rate) and
`1 / slowest_hz` (text must still read as streaming). Cheap frames (one reply
streaming, a fast CPU) keep the timer's rate; expensive ones (eight replies, a
layout every other frame) slow down to stay near the budget. An idle UI costs
almost nothing, so its ticks all draw.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class FramePacer:
    """Say, at each timer tick, whether to draw; the interval adapts to the UI thread's cost."""

    def __init__(
        self,
        *,
        budget: float,
        tick_s: float,
        slowest_hz: float,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        if not 0 < budget <= 1:
            raise ValueError("budget is a share of one core, in (0, 1]")
        self.budget = budget
        self.tick_s = tick_s
        self.longest_s = max(tick_s, 1 / slowest_hz)
        self._clock = clock
        self._cpu_clock = cpu_clock  # must measure the thread that calls `should_draw`
        self._cpu = cpu_clock()
        self._next = 0.0
        self.interval_s = tick_s  # the latest interval chosen (the meters may show it)

    def should_draw(self) -> bool:
        """True when this tick draws a frame; the cost since the previous frame sets the next."""
        now = self._clock()
        if now < self._next:
            return False
        cpu = self._cpu_clock()
        cost, self._cpu = cpu - self._cpu, cpu
        self.interval_s = min(max(cost / self.budget, self.tick_s), self.longest_s)
        # due half a tick early: the tick nearest the chosen time draws, not the one after it
        self._next = now + self.interval_s - self.tick_s / 2
        return True
