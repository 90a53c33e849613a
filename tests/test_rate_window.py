"""Rates over a sliding window: each kind counted from when its own work began."""

from __future__ import annotations

import pytest

from kvchat.rate_window import RateWindow


def test_a_decode_after_a_long_prefill_is_not_diluted_by_the_prefill_seconds() -> None:
    """Three seconds of prefill steps, then decode steps of 10 ms: the decode rate is
    the decode's own (100 a second), not its tokens over the prefill's seconds too."""
    window = RateWindow(5.0, kinds=2)
    t = 0.0
    for _ in range(3):  # prefill chunks, a second each
        window.add(t + 1.0, 0, 512, started=t)
        t += 1.0
    for _ in range(50):
        window.add(t + 0.01, 1, 0, started=t)
        t += 0.01
    assert window.rate(t, 0) == pytest.approx(100.0)
    assert window.rate(t, 1) == pytest.approx(1536 / t)


def test_rates_fall_once_the_work_stops_and_end_with_the_window() -> None:
    window = RateWindow(2.0)
    for i in range(10):
        window.add(0.1 * (i + 1), 1, started=0.1 * i)
    assert window.rate(1.0) == pytest.approx(10.0)
    assert window.rate(2.0) == pytest.approx(5.0)  # nothing since 1.0
    assert window.rate(3.5) is None  # every entry left the window


def test_arrivals_without_a_start_count_from_the_first_one() -> None:
    """Token arrivals: the first marks when the span starts; its own count is before it."""
    window = RateWindow(2.0)
    window.add(1.0, 1)
    assert window.rate(1.0) is None  # one arrival alone says nothing
    for i in range(1, 11):
        window.add(1.0 + 0.1 * i, 1)
    assert window.rate(2.0) == pytest.approx(10.0)


def test_work_added_to_the_last_step_counts_in_it() -> None:
    window = RateWindow(5.0, kinds=2)
    window.add(1.0, 0, 0, started=0.0)  # a step whose prefill tokens are known later
    window.add_to_last(1, 300)
    assert window.rate(1.0, 1) == pytest.approx(300.0)
    assert window.rate(1.0, 0) is None


def test_counts_must_match_the_kinds() -> None:
    with pytest.raises(ValueError):
        RateWindow(1.0, kinds=2).add(0.0, 1)
