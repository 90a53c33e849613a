"""The heap's free memory goes back to the OS once a burst of long steps is over: once,
not between the burst's steps, and never at the cost of a step."""

from __future__ import annotations

import random
import sys

import pytest

from kvchat.engine import heap_trim
from kvchat.engine.heap_trim import LONG_STEP_ROWS, HeapTrim, glibc_malloc_trim
from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine


def counting_trim() -> tuple[HeapTrim, list[int]]:
    calls: list[int] = []
    return HeapTrim(lambda: calls.append(1)), calls


def test_a_burst_of_long_steps_is_trimmed_once_after_it() -> None:
    heap, calls = counting_trim()
    heap.after_step(3)  # short steps alone owe nothing
    heap.at_idle()
    assert calls == []
    for _ in range(3):
        heap.after_step(LONG_STEP_ROWS + 100)
    assert calls == []  # the burst's steps reuse each other's buffers
    heap.after_step(4)
    assert calls == [1]
    heap.after_step(4)
    heap.at_idle()
    assert calls == [1]  # paid once
    heap.after_step(LONG_STEP_ROWS)
    heap.at_idle()
    assert calls == [1, 1] and heap.trims == 2


def test_a_failing_trim_is_logged_and_the_engine_goes_on(caplog) -> None:
    def broken() -> None:
        raise OSError("no")

    heap = HeapTrim(broken)
    heap.after_step(LONG_STEP_ROWS)
    heap.after_step(1)
    assert heap.trims == 0 and "malloc_trim failed" in caplog.text
    heap.after_step(1)  # not owed any more: not tried again
    assert caplog.text.count("malloc_trim failed") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_glibc_trim_runs_here() -> None:
    trim = glibc_malloc_trim()
    assert trim is not None
    trim()


def test_the_engine_trims_after_a_long_prompt(tiny_llama_dir, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "glibc_malloc_trim", lambda: lambda: calls.append(1))
    model = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    rng = random.Random(0)
    with small_engine(model) as engine:
        for n in (20, LONG_STEP_ROWS + 40):
            c = Collector()
            prompt = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(n))
            engine.submit(GenerationRequest(prompt, SamplingParams(), max_tokens=3), c)
            assert c.wait().reason.value in ("stop", "length")
            engine.run_until_idle()
            assert len(calls) == (0 if n < LONG_STEP_ROWS else 1)


def test_loading_a_model_gives_back_what_it_freed(tiny_llama_dir, monkeypatch) -> None:
    """The prepared layers' copies are freed once the arena holds them: trimmed at once."""
    from kvchat.model import loader

    calls: list[int] = []
    monkeypatch.setattr(loader, "glibc_malloc_trim", lambda: lambda: calls.append(1))
    load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert calls == [1]
