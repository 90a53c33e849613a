"""Every family beyond Llama through the cache's tiers: a conversation resumed with its
prefix from the device, from the host tier (after another evicted it) and from the
disk tier (after a restart) writes what a cold engine writes. Qwen3's q/k norms,
SmolLM3's layers without rotary, Phi-3's partial LongRoPE, Qwen3-MoE's experts, Gemma 3's
windows, Ministral 3's YaRN and gpt-oss's sinks all shape the K/V the tiers keep, so each
family is checked, not only Llama's."""

from __future__ import annotations

import pytest

from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT, write_tiny_model

FAMILIES = ["qwen3", "qwen3_moe", "smollm3", "phi3", "gemma3_text", "ministral3", "gpt_oss"]
PAGE = 16


def turn(engine, ids: list[int], tokens: int = 8):
    c = Collector()
    engine.submit(GenerationRequest(tuple(ids), max_tokens=tokens, ignore_eos=True), c)
    done = c.wait()
    assert done.error is None, done.error
    return done


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(str(folder), dtype="float32", device="cpu")


def settings(model, **kw) -> dict:
    """Eight pages on the device, so a second conversation evicts the first."""
    c = model.config
    page_bytes = c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * 4
    context = {"context_tokens": PHI3_ORIGINAL_CONTEXT} if c.model_type == "phi3" else {}
    return dict(device_cache_bytes=8 * page_bytes, page_size=PAGE, **context, **kw)


def test_a_resumed_conversation_writes_what_a_cold_engine_writes(model, tmp_path):
    a = [(7 * i) % 400 + 3 for i in range(72)]  # 4 full pages and a part
    b = [(11 * i) % 400 + 5 for i in range(72)]
    follow_up = [*a, 17, 23, 29]
    with small_engine(model, **settings(model, host_cache_bytes=0)) as cold:
        expected = turn(cold, follow_up).generated_ids

    disk = dict(disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv")
    with small_engine(model, **settings(model, host_cache_bytes=1 << 20, **disk)) as engine:
        turn(engine, a)
        again = turn(engine, follow_up)  # its prefix still on the device
        assert again.cached_tokens.device >= 64 and again.generated_ids == expected
        turn(engine, b)  # takes the device pages: a's go to the host tier
        assert engine.residency(a).host > 0
        back = turn(engine, follow_up)
        assert back.cached_tokens.host > 0 and back.generated_ids == expected
    with small_engine(model, **settings(model, host_cache_bytes=0, **disk)) as restarted:
        after = turn(restarted, follow_up)
        assert after.cached_tokens.disk > 0 and after.generated_ids == expected
