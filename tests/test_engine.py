"""The engine: continuous batching, streaming, cancellation, preemption, thread safety."""

from __future__ import annotations

import gc
import random
import threading

import pytest

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.events import PrefillProgress, RequestFinished, TokenGenerated
from kvchat.engine.request import FinishReason, GenerationRequest, SamplingParams
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def smollm_fp32(default_gguf_path):
    return load_model(str(default_gguf_path), dtype="float32", device="cpu")


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 120))] for _ in range(n)]


def run_alone(model, prompt, max_tokens, **kw) -> tuple[int, ...]:
    with small_engine(model, **kw) as engine:
        c = Collector()
        engine.submit(GenerationRequest(tuple(prompt), max_tokens=max_tokens, ignore_eos=True), c)
        return c.wait().generated_ids


@pytest.mark.real_model
def test_eight_concurrent_requests_match_their_solo_greedy_outputs(smollm_fp32):
    texts = [
        "Write a haiku about the sea.",
        "What is the capital of Japan?",
        "List three prime numbers.",
        "Explain recursion briefly to a child who likes cats and dogs and trains.",
        "Say hello.",
        "What color is the sky on Mars?",
        "Give me a word that rhymes with cat.",
        "Translate 'good morning' to French.",
    ]
    ids = [smollm_fp32.renderer.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    solo = [run_alone(smollm_fp32, p, 16) for p in ids]
    with small_engine(smollm_fp32) as engine:
        collectors = [Collector() for _ in ids]
        for p, c in zip(ids, collectors, strict=True):
            engine.submit(GenerationRequest(tuple(p), max_tokens=16, ignore_eos=True), c)
        together = [c.wait().generated_ids for c in collectors]
        engine.validate_cache()
    assert together == solo


def test_running_streams_keep_producing_during_a_long_prefill(tiny):
    with small_engine(tiny, step_token_budget=64, max_batch=8) as engine:
        streams = [Collector() for _ in range(3)]
        for i, c in enumerate(streams):
            engine.submit(GenerationRequest((5 + i, 6, 7), max_tokens=200, ignore_eos=True), c)
        while not all(any(isinstance(e, TokenGenerated) for e in c.events) for c in streams):
            threading.Event().wait(0.01)
        long = Collector()
        long_prompt = prompts(1, 500, seed=3)[0] * 8  # ~hundreds of tokens: many 64-token chunks
        engine.submit(GenerationRequest(tuple(long_prompt), max_tokens=4, ignore_eos=True), long)
        finished = long.wait()
        start = next(e.time for e in long.events if isinstance(e, PrefillProgress))
        first = next(e.time for e in long.events if isinstance(e, TokenGenerated))
        for c in streams:
            during = [
                e for e in c.events if isinstance(e, TokenGenerated) and start <= e.time <= first
            ]
            assert len(during) >= 3, "a stream stalled during another request's prefill"
        for c in streams:
            c.wait()
        assert finished.prefilled_tokens == len(long_prompt)
    assert finished.generated_ids == run_alone(tiny, long_prompt, 4)


def test_cancel_mid_prefill_and_mid_decode_releases_pages(tiny):
    with small_engine(tiny, step_token_budget=32) as engine:
        in_prefill = Collector()
        long_prompt = prompts(1, 500, seed=4)[0] * 10
        rid = engine.submit(GenerationRequest(tuple(long_prompt), max_tokens=50), in_prefill)
        while not any(isinstance(e, PrefillProgress) for e in in_prefill.events):
            threading.Event().wait(0.005)
        engine.cancel(rid)
        assert in_prefill.wait().reason == FinishReason.CANCELLED

        in_decode = Collector()
        rid = engine.submit(
            GenerationRequest((5, 6, 7), max_tokens=10_000, ignore_eos=True), in_decode
        )
        while sum(isinstance(e, TokenGenerated) for e in in_decode.events) < 3:
            threading.Event().wait(0.005)
        engine.cancel(rid)
        done = in_decode.wait()
        assert done.reason == FinishReason.CANCELLED
        assert 3 <= done.generated_tokens < 10_000
        engine.close()
        engine.validate_cache()
        stats = engine.table.stats()
        assert stats.pages.device.active == 0
        assert stats.pages.device.cached > 0  # the computed pages stayed as prompt cache


def test_preemption_when_active_requests_exhaust_the_pool_keeps_outputs_correct(tiny):
    ps = tiny.transformer.dtype  # noqa: F841 - keep the fixture warm
    work = prompts(4, 500, seed=5)
    work = [(p * 3)[:60] for p in work]  # 60-token prompts, 40 new tokens: 7 pages of 16 each
    solo = [run_alone(tiny, p, 40) for p in work]
    per_token = 2 * tiny.config.num_layers * tiny.config.num_kv_heads * tiny.config.head_dim * 4
    with small_engine(tiny, device_cache_bytes=18 * 16 * per_token, host_cache_bytes=0) as engine:
        cs = [Collector() for _ in work]
        for p, c in zip(work, cs, strict=True):
            engine.submit(GenerationRequest(tuple(p), max_tokens=40, ignore_eos=True), c)
        results = [c.wait() for c in cs]
        assert engine.stats().preemptions > 0
        engine.validate_cache()
    assert [r.generated_ids for r in results] == solo
    assert all(r.reason == FinishReason.LENGTH for r in results)
    assert sum(r.recomputed_tokens for r in results) > 0


def test_submit_and_cancel_from_many_threads_is_safe(tiny):
    with small_engine(tiny) as engine:
        finished: list[RequestFinished] = []
        lock = threading.Lock()

        def on_event(event) -> None:
            if isinstance(event, RequestFinished):
                with lock:
                    finished.append(event)

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for p in prompts(6, 500, seed=seed):
                rid = engine.submit(
                    GenerationRequest(tuple(p), max_tokens=rng.randrange(1, 12)), on_event
                )
                if rng.random() < 0.5:
                    engine.cancel(rid)
                engine.stats()
                engine.residency(p)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        deadline = threading.Event()
        for _ in range(1200):
            with lock:
                if len(finished) == 24:
                    break
            deadline.wait(0.05)
        engine.close()
        engine.validate_cache()
    assert len(finished) == 24
    assert engine.table.stats().pages.device.active == 0


def test_same_seed_gives_same_sample_whatever_else_is_in_the_batch(tiny):
    sampling = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    request = GenerationRequest((9, 8, 7), sampling, max_tokens=20, ignore_eos=True)
    with small_engine(tiny) as engine:
        alone = Collector()
        engine.submit(request, alone)
        first = alone.wait().generated_ids
    with small_engine(tiny) as engine:
        others = [Collector() for _ in range(3)]
        for i, c in enumerate(others):
            engine.submit(GenerationRequest((i + 3,) * 7, max_tokens=30, ignore_eos=True), c)
        again = Collector()
        engine.submit(request, again)
        assert again.wait().generated_ids == first


def test_stop_strings_end_the_reply_and_are_not_emitted(tiny):
    with small_engine(tiny) as engine:
        c = Collector()
        engine.submit(GenerationRequest((5, 6, 7), max_tokens=40, ignore_eos=True), c)
        full = c.wait().text
    assert len(full) > 6
    stop = full[3:6]
    with small_engine(tiny) as engine:
        c = Collector()
        engine.submit(
            GenerationRequest((5, 6, 7), max_tokens=40, ignore_eos=True, stop_strings=(stop,)), c
        )
        done = c.wait()
    assert done.reason == FinishReason.STOP
    assert done.text == full[: full.index(stop)]
    assert "".join(e.text for e in c.events if isinstance(e, TokenGenerated)) == done.text


def test_prompt_longer_than_the_context_fails_with_a_clear_error(tiny):
    with small_engine(tiny) as engine:
        c = Collector()
        engine.submit(
            GenerationRequest((5,) * (tiny.config.max_position_embeddings + 1), max_tokens=4), c
        )
        done = c.wait()
    assert done.reason == FinishReason.ERROR
    assert "context" in (done.error or "")


def test_an_internal_error_fails_live_requests_instead_of_hanging(tiny, monkeypatch):
    with small_engine(tiny) as engine:
        c = Collector()

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)
        engine.submit(GenerationRequest((5, 6, 7), max_tokens=4), c)
        done = c.wait(timeout=30)
        assert done.reason == FinishReason.ERROR
        assert "internal error" in (done.error or "")


def test_non_finite_logits_fail_only_their_request_with_a_clear_message(tiny, monkeypatch):
    """A row of NaN logits (a corrupt model, an overflowing dtype) ends that request with a
    message that says what to do; the other request in the same steps decodes on."""
    with small_engine(tiny) as engine:
        forward = engine.transformer.forward
        poisoned = (11, 12, 13, 14)

        def forward_with_a_nan_row(batch, attention):
            logits = forward(batch, attention).clone()  # an inference tensor: edit a copy
            ends = batch.logits_indices.tolist()
            for row, token_index in enumerate(ends):
                if int(batch.input_ids[token_index]) in poisoned:
                    logits[row] = float("nan")
            return logits

        monkeypatch.setattr(engine.transformer, "forward", forward_with_a_nan_row)
        bad, good = Collector(), Collector()
        engine.submit(GenerationRequest(poisoned, max_tokens=4, ignore_eos=True), bad)
        engine.submit(GenerationRequest((5, 6, 7), max_tokens=4, ignore_eos=True), good)
        failed, finished = bad.wait(timeout=60), good.wait(timeout=60)
    assert failed.reason == FinishReason.ERROR
    assert "NaN" in (failed.error or "") and "--dtype float32" in (failed.error or "")
    assert finished.reason == FinishReason.LENGTH and len(finished.generated_ids) == 4


def test_an_idle_engine_faults_its_kv_store_in_slices_and_yields_to_a_new_request(
    tiny, monkeypatch
):
    """Idle steps touch the store `TOUCH_BYTES_PER_STEP` at a time, lowest pages first; a
    request that arrives meanwhile is computed on the very next step; once the whole
    store is touched an idle step does nothing, and the outputs are what they were."""
    from kvchat.engine import idle_housekeeping
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.tiers.kv_store import kv_bytes_per_token

    c = tiny.config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, tiny.dtype)
    page_bytes = 16 * per_token
    monkeypatch.setattr(idle_housekeeping, "TOUCH_BYTES_PER_STEP", 3 * page_bytes)
    config = EngineConfig(device_cache_bytes=20 * page_bytes, host_cache_bytes=0, page_size=16)
    prompt = tuple(range(3, 43))
    with Engine(tiny, config, start=False) as engine:
        touched: list[tuple[int, int]] = []
        real_touch = engine.store.touch
        monkeypatch.setattr(
            engine.store, "touch", lambda a, b: (touched.append((a, b)), real_touch(a, b))
        )
        assert engine.step() is True and touched == [(0, 3)]
        got = Collector()
        engine.submit(GenerationRequest(prompt, max_tokens=4, ignore_eos=True), got)
        engine.step()
        assert len(touched) == 1, "the new request waited for the store to be touched"
        while not got.done.is_set():
            engine.step()
        while engine.step():
            pass
        assert engine.step() is False
        starts = [a for a, _ in touched]
        assert starts == sorted(starts) and touched[-1][1] == engine.store.num_pages
        assert all(b - a <= 3 for a, b in touched)
        assert sum(b - a for a, b in touched) == engine.store.num_pages
    with Engine(tiny, config, start=False) as fresh:  # never idle before the request
        again = Collector()
        fresh.submit(GenerationRequest(prompt, max_tokens=4, ignore_eos=True), again)
        while not again.done.is_set():
            fresh.step()
    assert got.wait().generated_ids == again.wait().generated_ids


def test_idle_defragmentation_runs_in_slices_and_yields_to_a_new_request(tiny, monkeypatch):
    """The idle engine moves at most `DEFRAG_PAGES_PER_STEP` pages a step: a request that
    arrives meanwhile is computed on the very next step, and the pass finishes after it."""
    from kvchat.engine import idle_housekeeping
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.tiers.kv_store import kv_bytes_per_token

    monkeypatch.setattr(idle_housekeeping, "DEFRAG_PAGES_PER_STEP", 4)
    c = tiny.config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, tiny.dtype)
    config = EngineConfig(  # 48 pages: the two prompts' 33 pages are most of them
        device_cache_bytes=48 * 16 * per_token,
        host_cache_bytes=0,
        page_size=16,
        step_token_budget=32,
    )
    with Engine(tiny, config, start=False) as engine:
        a, b = Collector(), Collector()  # prefilled side by side: their pages interleave
        engine.submit(GenerationRequest(tuple(range(3, 303)), max_tokens=2, ignore_eos=True), a)
        engine.submit(GenerationRequest(tuple(range(5, 205)), max_tokens=2, ignore_eos=True), b)
        while not (a.done.is_set() and b.done.is_set()):
            engine.step()
        moved_before = engine.table.defragment  # the engine's own calls, counted
        moves: list[int] = []

        def counted(max_moves=None, *, resuming=False):
            n = moved_before(max_moves, resuming=resuming)
            moves.append(n)
            return n

        monkeypatch.setattr(engine.table, "defragment", counted)
        assert engine.step() is True  # an idle step that moved pages
        assert 0 < moves[-1] <= 4
        c = Collector()
        engine.submit(GenerationRequest(tuple(range(7, 27)), max_tokens=1, ignore_eos=True), c)
        engine.step()
        assert c.done.is_set(), "the new request waited for the defragmentation"
        calls = len(moves)
        while engine.step():
            pass
        engine.validate_cache()
        assert len(moves) > calls + 1 and moves[-1] == 0  # resumed in slices, then settled
        assert all(n <= 4 for n in moves)
        for prompt in (range(3, 303), range(5, 205)):  # still cached, all of it
            assert engine.table.residency(tuple(prompt)).device == len(prompt)


def test_a_launched_engine_takes_the_objects_alive_at_start_out_of_gc_walks(tiny):
    """`Engine.launch` freezes what the model load left alive, so collections during steps
    do not walk the model's objects (see `freeze_long_lived_objects`)."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine = Engine.launch(
        lambda: tiny, EngineConfig(device_cache_bytes=4 << 20, host_cache_bytes=0)
    )
    try:
        assert gc.get_freeze_count() > 0
        collector = Collector()
        engine.submit(GenerationRequest((1, 2, 3), max_tokens=3, ignore_eos=True), collector)
        assert collector.wait().reason == FinishReason.LENGTH
    finally:
        engine.close()
        gc.unfreeze()


def test_the_decode_rate_is_not_diluted_by_the_prefill_before_it(tiny) -> None:
    """A prompt prefilled over slow steps, then a fast decode: the engine's decode rate
    counts from the first decode step, so it matches the reply's own rate instead of
    spreading its tokens over the prefill's seconds ("all 2 tok/s" beside "this 99")."""
    import time

    config = EngineConfig(
        device_cache_bytes=16 << 20, host_cache_bytes=0, page_size=16, step_token_budget=16
    )
    with Engine(tiny, config, start=False) as engine:
        got = Collector()
        engine.submit(GenerationRequest(tuple(range(3, 67)), max_tokens=40, ignore_eos=True), got)
        while not any(isinstance(e, TokenGenerated) for e in got.events):
            engine.step()
            time.sleep(0.15)  # four slow prefill steps: 0.6 s before the first token
        first = time.monotonic()
        while not got.done.is_set():
            engine.step()
        own = (len(got.wait().generated_ids) - 1) / (time.monotonic() - first)
        assert engine.stats().decode_tok_s >= 0.5 * own
