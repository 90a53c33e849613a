"""`FramePacer`: frames at the timer's rate while cheap, slower (to a floor) while expensive."""

from __future__ import annotations

import threading
import time

import pytest

from kvchat.tui.frame_pacer import FramePacer

TICK = 0.05


class FakeThread:
    """A UI thread's wall clock and CPU clock, advanced by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu = 7.0

    def pacer(self, budget: float = 0.05, slowest_hz: float = 10.0) -> FramePacer:
        return FramePacer(
            budget=budget,
            tick_s=TICK,
            slowest_hz=slowest_hz,
            clock=lambda: self.now,
            cpu_clock=lambda: self.cpu,
        )

    def run(self, pacer: FramePacer, ticks: int, frame_cpu: float) -> list[bool]:
        """`ticks` timer ticks; each drawn frame costs `frame_cpu` of the thread's CPU."""
        drawn = []
        for _ in range(ticks):
            draw = pacer.should_draw()
            drawn.append(draw)
            if draw:
                self.cpu += frame_cpu
            self.now += TICK
        return drawn


def test_cheap_frames_draw_on_every_tick():
    thread = FakeThread()
    pacer = thread.pacer(budget=0.05)
    assert all(thread.run(pacer, 40, frame_cpu=0.002))  # 2 ms a frame: 4% of a core at 20 Hz
    assert pacer.interval_s == TICK


def test_expensive_frames_slow_down_to_stay_near_the_budget():
    thread = FakeThread()
    pacer = thread.pacer(budget=0.05, slowest_hz=4.0)
    drawn = thread.run(pacer, 200, frame_cpu=0.0075)  # 7.5 ms a frame: 150 ms apart at 5%
    steady = drawn[20:]
    rate = sum(steady) / (len(steady) * TICK)
    assert 6.0 <= rate <= 7.0  # 1 / 0.15 s = 6.7 frames a second
    cpu_share = sum(steady) * 0.0075 / (len(steady) * TICK)
    assert cpu_share == pytest.approx(0.05, rel=0.1)


def test_the_frame_rate_never_falls_below_the_floor():
    thread = FakeThread()
    pacer = thread.pacer(budget=0.05, slowest_hz=10.0)
    drawn = thread.run(pacer, 100, frame_cpu=0.05)  # 50 ms a frame: 1 s apart at 5%
    assert sum(drawn[10:]) == 45  # every other tick: 10 frames a second
    assert pacer.interval_s == pytest.approx(0.1)


def test_the_rate_recovers_when_frames_get_cheap_again():
    thread = FakeThread()
    pacer = thread.pacer(budget=0.05, slowest_hz=5.0)
    assert not all(thread.run(pacer, 40, frame_cpu=0.02)[5:])
    assert all(thread.run(pacer, 40, frame_cpu=0.001)[10:])


def test_work_between_frames_counts_toward_their_cost():
    """Screen updates and events run between ticks, on the same thread: they count."""
    thread = FakeThread()
    pacer = thread.pacer(budget=0.05, slowest_hz=5.0)
    drawn = []
    for _ in range(60):
        drawn.append(pacer.should_draw())
        thread.cpu += 0.004  # 4 ms a tick outside the frames (8% of a core at 20 Hz)
        thread.now += TICK
    assert sum(drawn[10:]) < 50 * 0.7


def test_a_budget_outside_0_and_1_is_refused():
    with pytest.raises(ValueError):
        FramePacer(budget=0.0, tick_s=TICK, slowest_hz=10.0)
    with pytest.raises(ValueError):
        FramePacer(budget=1.5, tick_s=TICK, slowest_hz=10.0)


def test_the_default_cpu_clock_is_the_calling_threads():
    """Another thread's busy loop costs this thread's pacer nothing."""
    pacer = FramePacer(budget=0.05, tick_s=0.0, slowest_hz=1.0)
    assert pacer.should_draw()
    stop = time.perf_counter() + 0.05

    def spin() -> None:
        while time.perf_counter() < stop:
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    assert pacer.should_draw()  # the spin was not this thread's CPU
    assert pacer.interval_s < 0.5
