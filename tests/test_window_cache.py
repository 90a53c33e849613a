"""Gemma 3's windowed layers kept in window slots of their own, through the engine.

With fewer slots than pages, a live sequence holds the window part of its last pages
only, the parts it let go stay idle until other conversations want the slots, and a
switch back finds its window on the device, the host tier or the disk tier (a flag in
each copy says whether it has its part). Every answer is transformers' greedy text.
"""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, Progress, small_engine
from tests.parity_helpers import hf_model
from tests.tiny_models import write_tiny_model

PAGE = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


@pytest.fixture(scope="module")
def model(folder):
    return load_model(str(folder), dtype="float32", device="cpu")


def theirs(folder, ids: list[int], tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = hf_model(folder).generate(
            torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


def settings(model, pages: int, slots: int, **kw) -> dict:
    """A device cache of `pages` pages and `slots` window slots; steps of 16 tokens, so a
    live sequence and a step need few slots (`WindowSlots.admits`)."""
    c = model.config
    windowed = sum(1 for w in c.layer_windows if w is not None)
    per_layer = 2 * PAGE * c.num_kv_heads * c.head_dim * 4
    nbytes = pages * (c.num_layers - windowed) * per_layer + slots * windowed * per_layer
    return dict(
        device_cache_bytes=nbytes,
        page_size=PAGE,
        window_slots=slots,
        step_token_budget=16,
        max_batch=2,
        **kw,
    )


def turn(engine, ids: list[int], tokens: int = 8):
    c = Collector()
    engine.submit(GenerationRequest(tuple(ids), max_tokens=tokens, ignore_eos=True), c)
    done = c.wait()
    assert done.error is None, done.error
    return done


def conversation(seed: int, n: int = 72) -> list[int]:
    return [(seed * 13 + 7 * i) % 400 + 3 for i in range(n)]


@pytest.mark.parametrize("attention", ["native", "sdpa", "flex"])
def test_a_switch_back_computes_only_what_is_new_and_a_lost_window_is_recomputed(
    folder, model, attention
):
    a = conversation(1)
    follow_up = [*a, 17, 23, 29]
    expected = theirs(folder, follow_up)
    config = settings(model, pages=40, slots=9, host_cache_bytes=0, attention=attention)
    with small_engine(model, **config) as engine:
        window = engine.table.window
        assert window is not None and not window.unbounded
        assert engine.window_store is not None and engine.window_store.num_pages == 9
        turn(engine, a)
        again = turn(engine, follow_up)
        assert again.cached_tokens.device == 72 and again.generated_ids == tuple(expected)
        for seed in (2, 3, 4):  # their windows take every idle slot: a's parts are let go
            turn(engine, conversation(seed))
        assert window.let_go > 0
        lost = turn(engine, follow_up)
        assert lost.cached_tokens.device < 72 and lost.generated_ids == tuple(expected)
        engine.validate_cache()


def test_the_window_comes_back_from_the_host_and_disk_tiers(folder, model, tmp_path):
    a, b = conversation(1), conversation(2, 120)
    follow_up = [*a, 17, 23, 29]
    expected = theirs(folder, follow_up)
    disk = dict(disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv")
    config = settings(model, pages=9, slots=9, host_cache_bytes=1 << 20, **disk)
    with small_engine(model, **config) as engine:
        assert engine.table.window is not None and not engine.table.window.unbounded
        turn(engine, a)
        turn(engine, b)  # takes the device pages: a's go to the host tier
        assert engine.residency(a).host > 0
        back = turn(engine, follow_up)
        assert back.cached_tokens.host > 0 and back.generated_ids == tuple(expected)
        assert back.cached_tokens.total >= 64
    with small_engine(model, **settings(model, pages=9, slots=9, host_cache_bytes=0, **disk)) as e:
        after = turn(e, follow_up)
        assert after.cached_tokens.disk >= 64 and after.generated_ids == tuple(expected)


def test_the_stats_show_the_window_slots(model):
    with small_engine(model, **settings(model, pages=40, slots=9, host_cache_bytes=0)) as engine:
        turn(engine, conversation(1))
        stats = engine.stats()
        assert stats.window is not None and stats.window.capacity == 8
        assert stats.window.active == 0 and stats.window.cached > 0
        body = stats.to_json()
        assert body["window_slots"]["capacity"] == 8 and body["window_let_go"] == 0


def test_a_type_ahead_beside_a_stream_stays_within_the_slots(model):
    """A type-ahead's chunk beside decodes is bounded by the step budget the window slots
    are sized by, even when its pacer would give it more (up to `MAX_CHUNK` tokens): the
    stream and the type-ahead both finish (with 8 slots the stream's window takes the
    draft's idle parts soon after, so its reuse is not asserted here)."""
    from kvchat.engine.type_ahead_pacer import MAX_CHUNK

    draft = conversation(5, 200)
    with small_engine(model, **settings(model, pages=40, slots=9, host_cache_bytes=0)) as engine:
        engine.scheduler.type_ahead_pacer.chunk = lambda decode_step_s: MAX_CHUNK
        stream = Collector()
        engine.submit(
            GenerationRequest(tuple(conversation(6, 20)), max_tokens=200, ignore_eos=True), stream
        )
        progress = Progress()
        engine.type_ahead(draft, progress)
        assert progress.wait_done().ready_tokens == len(draft)
        assert stream.wait().error is None
        engine.validate_cache()
