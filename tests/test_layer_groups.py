"""The windowed layers' own store: which layer lives where, and pages moved between the
stores and the host and disk tiers in the model's layer order."""

from __future__ import annotations

import torch

from kvchat.engine.cache.window_slots import WindowSlots
from kvchat.engine.layer_groups import LayerGroups
from kvchat.engine.tiers.kv_store import DeviceKVStore, HostKVStore, KVPageMover

PAGES, S, HKV, D = 4, 16, 2, 8


def test_a_model_with_both_kinds_of_layer_splits_them():
    groups = LayerGroups.of([8, 8, None, 8, 8, None], 6)
    assert groups.split and groups.window == 8
    assert groups.full == (2, 5) and groups.windowed == (0, 1, 3, 4)
    assert groups.locations() == (
        (True, 0), (True, 1), (False, 0), (True, 2), (True, 3), (False, 1),
    )  # fmt: skip


def test_one_kind_of_layer_keeps_one_store():
    for windows in (None, [None] * 3, [8] * 3):
        groups = LayerGroups.of(windows, 3)
        assert not groups.split and groups.full == (0, 1, 2)
        assert groups.locations() == ((False, 0), (False, 1), (False, 2))


def _stores(groups: LayerGroups, kv_format: str):
    full = DeviceKVStore(len(groups.full), PAGES, S, HKV, D, torch.float32, "cpu", kv_format)
    window = DeviceKVStore(
        len(groups.windowed), PAGES + 1, S, HKV, D, torch.float32, "cpu", kv_format
    )
    host = HostKVStore(3, groups.num_layers, S, HKV, D, torch.float32, "cpu", kv_format)
    for t in (*full.parts, *window.parts):
        t.copy_(torch.randn(t.shape).to(t.dtype) if t.dtype != torch.int8 else t.random_(-9, 9))
    return full, window, host


def test_a_page_reaches_the_host_and_disk_in_model_order_and_comes_back():
    groups = LayerGroups.of([8, None, 8, 8], 4)
    for kv_format in ("native", "int8"):
        full, window, host = _stores(groups, kv_format)
        slots = WindowSlots(PAGES + 1, 8, S, 64, PAGES)
        for page in (2, 0, 1):  # page 3 keeps no window part
            slots.give(page)
        mover = KVPageMover(full, host, window, groups, slots)
        snapshot = mover.snapshot_device(2)
        assert mover.window_of_parts(snapshot)
        ws = slots.slot(2)
        for part_full, part_window, page in zip(
            full.parts, window.parts, snapshot[:-1], strict=True
        ):
            assert torch.equal(page[1], part_full[0, 2])  # layer 1 is the full one
            for i, layer in enumerate(groups.windowed):
                assert torch.equal(page[layer], part_window[i, ws])
        mover.device_to_host(2, 1)
        assert mover.window_of_host(1)
        assert all(torch.equal(h[1], t) for h, t in zip(host.parts, snapshot[:-1], strict=True))
        mover.host_to_device(1, 0)
        for store, index in ((full, lambda p: p), (window, slots.slot)):
            for part in store.parts:
                assert torch.equal(part[:, index(0)], part[:, index(2)])

        # a page without its window part: zeros and a flag in its copies, nothing written back
        bare = mover.snapshot_device(3)
        assert not mover.window_of_parts(bare)
        assert all(bool((t[list(groups.windowed)] == 0).all()) for t in bare[:-1])
        mover.device_to_host(3, 2)
        assert not mover.window_of_host(2)
        before = [part.clone() for part in window.parts]
        mover.load_device(bare, 1)  # page 1 has a slot, but the copy has no part for it
        assert all(torch.equal(a, b) for a, b in zip(before, window.parts, strict=True))
        assert all(torch.equal(part[:, 1], part[:, 3]) for part in full.parts)


def test_gemma_3_1b_shape_holds_about_2_7_times_the_tokens_in_the_same_memory():
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.kv_cache import _split_pool
    from kvchat.engine.tiers.kv_store import pages_for_bytes

    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = LayerGroups.of(windows, 26)
    assert len(groups.full) == 4
    config = EngineConfig(page_size=256)
    geometry = (256, 1, 256, torch.bfloat16)
    pages, slots = _split_pool(1 << 30, groups, config, geometry)
    before = pages_for_bytes(1 << 30, 26, *geometry)
    assert 2.6 < pages / before < 2.8 and slots == int(0.25 * pages)
    small_pages, small_slots = _split_pool(64 << 20, groups, config, geometry)
    assert small_slots == small_pages + 1  # a slot for every page: nothing is let go
