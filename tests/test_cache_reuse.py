"""The paged cache reuses what it holds: same logits as a cold prefill, switch-back
re-prefills only the new turn, and evicted pages come back from the host tier exactly."""

from __future__ import annotations

import random

import pytest
import torch

from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.engine.cache.page_hash import root_salt
from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.request import GenerationRequest
from kvchat.engine.tiers.host_tier import HostTier
from kvchat.engine.tiers.kv_store import DeviceKVStore, HostKVStore, KVPageMover
from kvchat.model.batch import ForwardBatch, NoCacheAttention
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine


class CacheHarness:
    """A page table, its stores and the paged attention, driven by hand (no engine thread)."""

    def __init__(self, model, page_size: int, num_pages: int, host_slots: int = 0):
        c = model.config
        dtype, device = model.transformer.dtype, model.transformer.device
        geometry = (c.num_layers, page_size, c.num_kv_heads, c.head_dim, dtype)
        self.model = model
        self.store = DeviceKVStore(c.num_layers, num_pages, *geometry[1:], device)
        self.host_store = HostKVStore(host_slots, *geometry, device) if host_slots else None
        self.table = PageTable(
            num_pages,
            page_size,
            root_salt(model.fingerprint, str(dtype), "native"),
            HostTier(host_slots) if host_slots else None,
            KVPageMover(self.store, self.host_store),
        )
        self.attention = PagedAttention(self.store.k_all, self.store.v_all)

    def prefill(self, seq_id: int, tokens: list[int]):
        """Reserve, compute what is not cached, commit; returns (reservation, last logits)."""
        r = self.table.reserve(seq_id, tokens, count_as="prompt")
        assert r is not None
        run = tokens[r.to_compute_from :]
        batch = ForwardBatch.from_runs([run], [r.to_compute_from])
        self.attention.prepare(batch, [self.table.pages(seq_id)])
        logits = self.model.transformer.forward(batch, self.attention)
        self.table.commit(seq_id, run)
        self.table.validate()
        return r, logits[0]


def cold_logits(model, tokens: list[int]) -> torch.Tensor:
    batch = ForwardBatch.from_runs([tokens], [0])
    return model.transformer.forward(batch, NoCacheAttention(batch))[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("shared", [16 * 20, 16 * 20 + 7])  # cached part ends on / mid page
def test_prompt_served_from_cache_gives_the_cold_prefill_logits(tiny, page_size, shared):
    rng = random.Random(page_size + shared)
    first = [rng.randrange(3, 500) for _ in range(400)]
    second = first[:shared] + [rng.randrange(3, 500) for _ in range(50)]
    h = CacheHarness(tiny, page_size, num_pages=64)
    h.prefill(1, first)
    h.table.release(1)
    r, logits = h.prefill(2, second)
    assert (
        r.cached_tokens == shared
    )  # full pages shared plus the tail copied from page `shared // S`
    expected = cold_logits(tiny, second)
    assert float((logits - expected).norm() / expected.norm()) < 1e-5


def test_evicted_pages_come_back_from_host_exactly_and_counters_add_up(tiny):
    rng = random.Random(7)
    a, b = ([rng.randrange(3, 500) for _ in range(16 * 10)] for _ in range(2))
    h = CacheHarness(tiny, 16, num_pages=12, host_slots=32)
    h.prefill(1, a)
    before = h.store.k_all[:, list(h.table.pages(1))[:10]].clone()
    h.table.release(1)
    h.prefill(2, b)  # needs the device pages a occupied: a goes to the host tier
    h.table.release(2)
    assert h.table.residency(a).host > 0
    r, logits = h.prefill(3, [*a, 11, 12, 13])
    assert r.cached.host > 0
    assert torch.equal(h.store.k_all[:, list(h.table.pages(3))[:10]], before)  # bit-exact
    expected = cold_logits(tiny, [*a, 11, 12, 13])
    assert float((logits - expected).norm() / expected.norm()) < 1e-5
    s = h.table.stats()
    assert s.counters.evictions.device_to_host > 0
    assert s.counters.prompt_tokens == s.counters.cached_tokens.total + s.counters.prefilled_tokens


def test_tail_first_eviction_keeps_the_longest_prefix(tiny):
    rng = random.Random(8)
    a = [rng.randrange(3, 500) for _ in range(16 * 8)]
    h = CacheHarness(tiny, 16, num_pages=12, host_slots=0)
    h.prefill(1, a)
    h.table.release(1)
    h.prefill(2, [rng.randrange(3, 500) for _ in range(16 * 6)])  # forces a's tail out
    h.table.release(2)
    resident = h.table.residency(a)
    assert 0 < resident.device < len(a)  # a prefix survives, not scattered pages
    r, _ = h.prefill(3, a)
    assert r.cached.device == resident.device


@pytest.fixture(scope="module")
def smollm_fp32(default_gguf_path):
    return load_model(str(default_gguf_path), dtype="float32", device="cpu")


@pytest.mark.real_model
def test_switch_back_reprefills_only_the_new_turn_and_matches_a_cold_run(smollm_fp32):
    model = smollm_fp32
    with small_engine(model, page_size=16) as engine:
        service = SessionService(
            engine, model.renderer, Store.in_memory(), stop_token_ids=model.tokenizer.stop_token_ids
        )
        finished: dict[str, list] = {}
        service.subscribe(
            lambda e: (
                finished.setdefault(e.session_id, []).append(e)
                if type(e).__name__ == "ReplyFinished"
                else None
            )
        )
        sa = service.create_session("A")
        sb = service.create_session("B")
        questions = ["Tell me about owls.", "What do they eat?", "Where do they live?"]
        ids_before_third = None
        for turn, q in enumerate(questions):
            for s in (sa, sb):
                if s == sa and turn == 2:
                    ids_before_third = list(service.token_ids(sa))
                service.say(s, q + (" (B)" if s == sb else ""), max_tokens=12)
                assert service.wait_idle(s, timeout=120)
        third = finished[sa][2]
        prompt_len = third.stats.prompt_tokens
        new_turn = prompt_len - len(ids_before_third)
        assert third.stats.prefilled_tokens == new_turn + 1
        prompt = service.token_ids(sa)[:prompt_len]
        reply = service.token_ids(sa)[prompt_len:]
        service.close()
    with small_engine(model) as cold_engine:
        c = Collector()
        cold_engine.submit(GenerationRequest(tuple(prompt), max_tokens=12), c)
        assert list(c.wait().generated_ids) == list(reply)
