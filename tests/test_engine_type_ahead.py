"""Type-ahead in the engine: prefill-only, cancellable, never in a prompt's way, pages reused."""

from __future__ import annotations

import threading

import pytest

from kvchat.engine.events import TokenGenerated
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, Progress, small_engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


def ids(n: int, start: int = 10) -> tuple[int, ...]:
    return tuple(start + (i * 7) % 200 for i in range(n))


def test_a_type_ahead_on_an_idle_engine_is_computed_and_its_turn_reuses_it(tiny) -> None:
    prompt = ids(100)
    with small_engine(tiny) as engine:
        progress = Progress()
        engine.type_ahead(prompt[:70], progress)
        assert progress.wait_done().ready_tokens == 70
        engine.validate_cache()
        stats = engine.stats()
        assert (
            stats.cache.draft_tokens,
            stats.cache.prompt_tokens,
            stats.cache.prefilled_tokens,
        ) == (70, 0, 0)
        c = Collector()
        engine.submit(GenerationRequest(prompt, max_tokens=2, ignore_eos=True), c)
        done = c.wait()
        assert done.cached_tokens.device == 70 and done.prefilled_tokens == 30
        assert done.draft_tokens == 70
        assert engine.stats().cache.draft_reused_tokens == 70
        engine.validate_cache()


def test_a_type_ahead_already_in_the_cache_computes_nothing(tiny) -> None:
    prompt = ids(60)
    with small_engine(tiny) as engine:
        engine.submit(GenerationRequest(prompt, max_tokens=1), c := Collector())
        c.wait()
        progress = Progress()
        engine.type_ahead(prompt[:40], progress)
        assert progress.wait_done().ready_tokens == 40
        assert engine.stats().cache.draft_tokens == 0


def test_a_replaced_or_cancelled_type_ahead_stops_and_keeps_what_it_computed(tiny) -> None:
    with small_engine(tiny, step_token_budget=16, max_batch=16) as engine:
        # a stream keeps the engine busy, so type-aheads only move in small chunks
        stream = Collector()
        request = GenerationRequest(ids(8, 3), max_tokens=400, ignore_eos=True)
        stream_id = engine.submit(request, stream)
        first = Progress()
        first_id = engine.type_ahead(ids(300), first)
        second = Progress()
        engine.type_ahead(ids(120, 50), second, replaces=first_id)
        second.wait_done()
        assert not first.done.is_set()
        third = Progress()
        third_id = engine.type_ahead(ids(400, 90), third)
        while not third.events or third.events[-1].ready_tokens == 0:
            threading.Event().wait(0.01)
        engine.cancel(third_id)
        engine.cancel(stream_id)
        stream.wait()
        engine.validate_cache()
        computed = third.events[-1].ready_tokens
        assert 0 < computed < 400
        assert engine.residency(ids(400, 90)[:computed]).device == computed
        assert any(isinstance(e, TokenGenerated) for e in stream.events)


def test_a_prompt_is_never_delayed_by_a_type_ahead(tiny) -> None:
    with small_engine(tiny, step_token_budget=32) as engine:
        progress = Progress()
        engine.type_ahead(ids(2000), progress)
        c = Collector()
        engine.submit(GenerationRequest(ids(40, 5), max_tokens=3, ignore_eos=True), c)
        c.wait()
        # the prompt finished while the type-ahead (64 steps of work) was still far from done
        assert not progress.done.is_set()
        assert engine.stats().drafts == 1
        progress.wait_done()


def test_pages_only_type_aheads_computed_are_evicted_before_any_turns(tiny) -> None:
    page = 16
    with small_engine(tiny, page_size=page) as engine:
        kv = engine.store.page_bytes()
    # a pool of 12 pages: a turn of 5 pages, a type-ahead of 5, then a turn needing 5 more
    with small_engine(tiny, device_cache_bytes=12 * kv, host_cache_bytes=0) as engine:
        assert engine.table.num_pages == 12
        turn = ids(5 * page - 1, 20)
        engine.submit(GenerationRequest(turn, max_tokens=1), c := Collector())
        c.wait()
        ahead = Progress()
        engine.type_ahead(ids(5 * page, 120), ahead)
        ahead.wait_done()
        engine.submit(GenerationRequest(ids(5 * page - 1, 60), max_tokens=1), c := Collector())
        c.wait()
        engine.validate_cache()
        # the first turn survived; the type-ahead lost its deepest pages
        assert engine.residency(turn).device == len(turn)
        assert engine.residency(ids(5 * page, 120)).device < 5 * page
