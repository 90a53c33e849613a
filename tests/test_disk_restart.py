"""The disk tier end to end with real tensors: K/V written at one engine's quit is read back
bit for bit by the next, counted as `cached_tokens.disk`, and shown in the stats."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
import torch

from kvchat.engine.cache.page_hash import page_hash, root_salt
from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.engine.tiers.disk_page import DiskPageFormat
from kvchat.engine.tiers.disk_tier import DiskTier
from kvchat.engine.tiers.kv_store import DeviceKVStore, KVPageMover
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine

L, P, S, H, D = 2, 6, 4, 2, 8


def table_with_disk(root: Path, kv_format: str) -> tuple[PageTable, DeviceKVStore, DiskTier]:
    salt = root_salt("restart-test", "bfloat16", kv_format)
    store = DeviceKVStore(L, P, S, H, D, torch.bfloat16, "cpu", kv_format)
    disk = DiskTier(root, DiskPageFormat(salt, S, L, H, D, "bfloat16", kv_format), 1 << 30)
    return PageTable(P, S, salt, None, KVPageMover(store, None), disk), store, disk


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_pages_read_back_after_a_restart_hold_the_same_bytes(tmp_path, kv_format) -> None:
    tokens = list(range(10, 20))  # 2 full pages + 2 tokens
    table, store, disk = table_with_disk(tmp_path, kv_format)
    assert table.reserve(1, tokens, count_as="prompt") is not None
    pages = table.pages(1)
    gen = torch.Generator().manual_seed(1)
    for part in store.parts:  # what the forward pass would have written
        noise = torch.randint(-100, 100, part[:, list(pages)].shape, generator=gen)
        part[:, list(pages)] = noise.to(part.dtype)
    written = [[part[:, p].clone() for part in store.parts] for p in pages[:2]]
    table.commit(1, tokens)
    table.release(1)
    disk.close()

    table2, store2, disk2 = table_with_disk(tmp_path, kv_format)  # the restart
    res = table2.reserve(7, [*tokens, 99], count_as="prompt")
    assert res is not None and res.cached.disk == 8 and res.cached.device == 0
    for p, want in zip(table2.pages(7)[:2], written, strict=True):
        for part, w in zip(store2.parts, want, strict=True):
            assert torch.equal(part[:, p].view(torch.uint8), w.view(torch.uint8))
    table2.validate()
    disk2.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


def run(engine: Engine, prompt: list[int], max_tokens: int = 3):
    c = Collector()
    engine.submit(GenerationRequest(tuple(prompt), max_tokens=max_tokens, ignore_eos=True), c)
    return c.wait()


def page_bytes_by_hash(engine: Engine, hashes: list[bytes]) -> dict[bytes, list[torch.Tensor]]:
    out = {}
    for i in range(engine.table.num_pages):
        info = engine.table.page_info(i)
        if info.indexed and info.hash in hashes:
            out[info.hash] = [part[:, i].clone() for part in engine.store.parts]
    return out


def test_a_restarted_engine_reads_the_history_from_disk(tiny, tmp_path) -> None:
    folder = tmp_path / "kv"
    prompt = [(7 * i) % 50 + 3 for i in range(40)]  # 2 full 16-token pages + 8
    disk_on = dict(disk_cache_bytes=64 << 20, disk_cache_dir=folder)
    salt = None
    with small_engine(tiny, **disk_on) as first:
        run(first, prompt)
        salt = first.table.salt
        hashes = [page_hash(salt, tuple(prompt[:16]))]
        hashes.append(page_hash(hashes[0], tuple(prompt[16:32])))
        before = page_bytes_by_hash(first, hashes)
    files = sorted(folder.rglob("*.safetensors"))
    assert len(files) == 2  # written by the time close() returned
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)

    with small_engine(tiny, **disk_on) as second:
        assert second.stats().pages.disk.cached == 2  # indexed at start
        done = run(second, [*prompt, 11, 12])
        assert done.cached_tokens.disk == 32 and done.cached_tokens.device == 0
        after = page_bytes_by_hash(second, hashes)
        for h in hashes:
            for a, b in zip(after[h], before[h], strict=True):
                assert torch.equal(a, b)
        second.validate_cache()
        stats = second.stats().to_json()
        assert stats["cached_tokens"]["disk"] == 32
        assert stats["pages"]["disk"]["cached"] == 2
        assert stats["disk_bytes"]["capacity"] == 64 << 20
        assert stats["disk_bytes"]["used"] == sum(f.stat().st_size for f in files)
        assert {"host_to_disk", "disk_dropped"} <= set(stats["evictions"])
        assert second.residency(prompt).device == 40


def test_without_the_disk_tier_a_restart_recomputes(tiny, tmp_path) -> None:
    prompt = [(5 * i) % 40 + 3 for i in range(40)]
    with small_engine(tiny, disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv") as e:
        run(e, prompt)
    with small_engine(tiny) as off:  # disk tier off: nothing carries over
        done = run(off, [*prompt, 1])
        assert done.cached_tokens.disk == 0 and done.prefilled_tokens == 41
        assert off.stats().pages.disk.capacity == 0


def test_switching_to_a_session_after_a_restart_prefetches_its_disk_pages(tiny, tmp_path) -> None:
    prompt = [(3 * i) % 45 + 3 for i in range(40)]
    disk_on = dict(disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv")
    with small_engine(tiny, **disk_on) as first:
        run(first, prompt)
    with small_engine(tiny, **disk_on) as second:
        assert second.residency(prompt).disk == 32
        second.prefetch(prompt)  # what focusing the session (or `switch`) does
        deadline = time.monotonic() + 60
        while second.residency(prompt).device < 32 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert second.residency(prompt).device == 32 and second.residency(prompt).disk == 0
        done = run(second, [*prompt, 5])
        assert done.cached_tokens.device == 32 and done.cached_tokens.disk == 0
