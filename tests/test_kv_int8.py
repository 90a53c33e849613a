"""The int8 KV cache: ~1.9x the tokens per byte, close logits, never mixed with other formats."""

from __future__ import annotations

import random

import pytest
import torch

from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.engine.cache.page_hash import root_salt
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.engine.tiers.kv_store import DeviceKVStore, HostKVStore, KVPageMover
from kvchat.model.batch import ForwardBatch
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


def last_logits(model, ids: list[int], kv_format: str) -> torch.Tensor:
    c = model.config
    store = DeviceKVStore(
        c.num_layers, 8, 64, c.num_kv_heads, c.head_dim, model.transformer.dtype, "cpu", kv_format
    )
    attention = PagedAttention.for_store(store)
    pages = [3, 1, 7, 5, 0, 2, 4, 6]
    out = None
    for start in range(0, len(ids), 50):  # prefill chunks, then the logits of the last token
        batch = ForwardBatch.from_runs([ids[start : start + 50]], [start])
        attention.prepare(batch, [pages])
        out = model.transformer.forward(batch, attention)
    assert out is not None
    return out[0]


def test_int8_kv_next_token_logits_are_close_to_native_kv(tiny):
    ids = [random.Random(1).randrange(3, 500) for _ in range(300)]
    native = last_logits(tiny, ids, "native")
    int8 = last_logits(tiny, ids, "int8")
    err = float((int8 - native).norm() / native.norm())
    assert err < 2e-2, err  # the stated tolerance: 2% relative L2


@pytest.mark.real_model
@pytest.mark.parametrize(
    "text",
    ["What is the capital of France?", "List three colors.", "Write a poem about the sea."],
)
def test_int8_kv_on_the_default_model_stays_close_to_native_kv(default_gguf_path, text):
    """Stated tolerance: 8% relative L2 on the next-token logits (measured 1.2-5.3%), and
    int8's choice among native's top 3 (the poem prompt has a near-tie: 26.32 vs 26.30).
    Perplexity over 2,000 tokens moves +0.33% (benchmarks/quality.py)."""
    model = load_model(str(default_gguf_path), dtype="float32", device="cpu", weights="bf16")
    ids = model.renderer.prompt_ids([{"role": "user", "content": text}])
    native = last_logits(model, ids, "native")
    int8 = last_logits(model, ids, "int8")
    assert float((int8 - native).norm() / native.norm()) < 0.08
    assert int(int8.argmax()) in native.topk(3).indices.tolist()


def test_int8_pages_round_trip_through_the_host_tier_unchanged():
    device = DeviceKVStore(2, 4, 16, 2, 8, torch.bfloat16, "cpu", "int8")
    host = HostKVStore(3, 2, 16, 2, 8, torch.bfloat16, "cpu", "int8")
    for t in device.parts:
        t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    before = [t[:, 2].clone() for t in device.parts]
    mover = KVPageMover(device, host)
    mover.device_to_host(2, 1)
    for t in device.parts:
        t[:, 3].zero_()
    mover.host_to_device(1, 3)
    assert all(torch.equal(t[:, 3], b) for t, b in zip(device.parts, before, strict=True))


def test_int8_device_tier_holds_at_least_1_85x_the_tokens(tmp_path):
    """With a real head size (64, as the default model's): 128 bytes of bf16 per head and
    token become 64 + 2; with tiny heads the per-token scale weighs more."""
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(
        tmp_path / "m", "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    budget = 8 << 20
    capacity = {}
    for dtype in ("bfloat16", "float32"):
        model = load_model(str(folder), dtype=dtype, device="cpu")
        assert model.config.head_dim == 64
        for fmt in ("native", "int8"):
            config = EngineConfig(
                page_size=16, device_cache_bytes=budget, host_cache_bytes=0, kv_format=fmt
            )
            with Engine(model, config) as e:
                capacity[fmt, dtype] = e.stats().pages.device.capacity
                assert e.store.nbytes() <= budget
    for dtype in ("bfloat16", "float32"):
        assert capacity["int8", dtype] >= 1.85 * capacity["native", dtype]


def test_int8_prefix_is_never_matched_by_native_kv(tiny):
    assert root_salt("m", "bfloat16", "int8") != root_salt("m", "bfloat16", "native")
    ids = tuple(range(5, 60))
    with Engine(
        tiny,
        EngineConfig(
            page_size=16, device_cache_bytes=4 << 20, host_cache_bytes=0, kv_format="int8"
        ),
    ) as e:
        c = Collector()
        e.submit(GenerationRequest(ids, max_tokens=2), c)
        c.wait()
        e.close()
        assert e.table.residency(ids).device > 0
        e.table.salt = root_salt(tiny.fingerprint, "float32", "native")  # as native KV sees them
        assert e.table.residency(ids).device == 0
