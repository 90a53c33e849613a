"""The physical KV store: page copies are bit-exact, touch only their slots, follow the table."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.tiers.host_tier import HostTier
from kvchat.engine.tiers.kv_store import (
    DeviceKVStore,
    HostKVStore,
    KVPageMover,
    kv_bytes_per_token,
    pages_for_bytes,
)
from tests.page_table_helpers import SALT

L, P, S, H, D = 3, 6, 4, 2, 8  # layers, pages, page size, kv heads, head dim
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(
    dtype: torch.dtype, device: str = "cpu", slots: int = 4
) -> tuple[DeviceKVStore, HostKVStore, KVPageMover]:
    dev = DeviceKVStore(L, P, S, H, D, dtype, device)
    gen = torch.Generator().manual_seed(0)
    dev.k_all.copy_(torch.randn(dev.k_all.shape, generator=gen).to(dtype))
    dev.v_all.copy_(torch.randn(dev.v_all.shape, generator=gen).to(dtype))
    host = HostKVStore(slots, L, S, H, D, dtype, for_device=device)
    return dev, host, KVPageMover(dev, host)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_page_round_trips_device_host_device_bit_exact(dtype: torch.dtype, device: str) -> None:
    dev, host, mover = make(dtype, device)
    k_page, v_page = dev.k_all[:, 2].clone(), dev.v_all[:, 2].clone()  # [L, S, H, D]
    untouched = dev.k_all[:, 0].clone()
    mover.device_to_host(2, 3)
    dev.k_all[:, 2].zero_()  # the page is reused for something else meanwhile
    dev.v_all[:, 2].zero_()
    mover.host_to_device(3, 5)
    mover.synchronize()
    assert torch.equal(dev.k_all[:, 5], k_page) and torch.equal(dev.v_all[:, 5], v_page)
    assert torch.equal(host.k_all[3], k_page.cpu())
    assert torch.equal(dev.k_all[:, 0], untouched)
    assert host.pinned == (device == "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_tokens_copies_only_the_first_n_slots(dtype: torch.dtype) -> None:
    dev, _, mover = make(dtype)
    src_k, dst_before = dev.k_all[:, 1].clone(), dev.k_all[:, 4].clone()
    src_v = dev.v_all[:, 1].clone()
    mover.copy_tokens(1, 4, 3)
    assert torch.equal(dev.k_all[:, 4, :3], src_k[:, :3])
    assert torch.equal(dev.v_all[:, 4, :3], src_v[:, :3])
    assert torch.equal(dev.k_all[:, 4, 3:], dst_before[:, 3:])  # slot 3 keeps its old data
    assert torch.equal(dev.k_all[:, 1], src_k)  # the source is untouched


def test_move_page_copies_every_layer() -> None:
    dev, _, mover = make(torch.float32)
    src_k, src_v = dev.k_all[:, 0].clone(), dev.v_all[:, 0].clone()
    mover.move_page(0, 5)
    assert torch.equal(dev.k_all[:, 5], src_k) and torch.equal(dev.v_all[:, 5], src_v)


def test_layer_views_share_storage_with_the_pool() -> None:
    dev, _, _ = make(torch.float32)
    assert dev.k(1).shape == (P, S, H, D)
    dev.k(1)[2, 3] = 7.0
    dev.v(2)[0, 0] = -3.0
    assert torch.all(dev.k_all[1, 2, 3] == 7.0) and torch.all(dev.v_all[2, 0, 0] == -3.0)


def test_sizes_follow_the_geometry() -> None:
    per_token = kv_bytes_per_token(30, 3, 64, torch.bfloat16)
    assert per_token == 2 * 30 * 3 * 64 * 2
    assert pages_for_bytes(10 * 256 * per_token + 5, 30, 256, 3, 64, torch.bfloat16) == 10
    assert pages_for_bytes(100, 30, 256, 3, 64, torch.float32) == 0
    dev = DeviceKVStore(L, P, S, H, D, torch.float32, "cpu")
    assert dev.nbytes() == P * S * kv_bytes_per_token(L, H, D, torch.float32)


def test_mover_refuses_a_host_store_of_another_geometry() -> None:
    dev = DeviceKVStore(L, P, S, H, D, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not match"):
        KVPageMover(dev, HostKVStore(2, L, S, H, D + 1, torch.float32))
    with pytest.raises(ValueError, match="does not match"):
        KVPageMover(dev, HostKVStore(2, L, S, H, D, torch.bfloat16))


def test_tensors_follow_the_page_table_through_eviction_and_restore() -> None:
    """The real mover under the real table: restored K/V equals what was computed."""
    dev = DeviceKVStore(L, P, S, H, D, torch.float32, "cpu")
    host = HostKVStore(8, L, S, H, D, torch.float32)
    table = PageTable(P, S, SALT, HostTier(8), KVPageMover(dev, host))

    def kv_of(tokens: list[int], pos: int) -> float:  # stands in for K/V of a prefix
        return float(hash(tuple(tokens[: pos + 1])) % 100_003)

    def turn(seq_id: int, tokens: list[int]) -> None:
        res = table.reserve(seq_id, tokens, count_as="prompt")
        assert res is not None
        pages = table.pages(seq_id)
        for pos in range(res.to_compute_from):  # what was cached holds the right values
            assert torch.all(dev.k_all[:, pages[pos // S], pos % S] == kv_of(tokens, pos))
            assert torch.all(dev.v_all[:, pages[pos // S], pos % S] == -kv_of(tokens, pos))
        for pos in range(res.to_compute_from, len(tokens)):
            dev.k_all[:, pages[pos // S], pos % S] = kv_of(tokens, pos)
            dev.v_all[:, pages[pos // S], pos % S] = -kv_of(tokens, pos)
        table.commit(seq_id, tokens[res.to_compute_from :])
        table.release(seq_id)
        table.validate()

    a = list(range(100, 118))  # 4 full pages + 2 tokens
    turn(1, a)
    turn(2, list(range(200, 215)))  # pushes a's tail to the host (and drops its partial page)
    assert table.residency(a).host > 0
    turn(3, [*a, 1, 2])
    assert table.stats().counters.cached_tokens.host > 0


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_touch_faults_pages_in_without_changing_a_byte(kv_format: str) -> None:
    """The engine's idle touch runs over live pages too: every byte must stay as it was."""
    dev = DeviceKVStore(L, P, S, H, D, torch.bfloat16, "cpu", kv_format=kv_format)
    gen = torch.Generator().manual_seed(1)
    for part in dev.parts:
        part.view(torch.uint8).copy_(torch.randint(0, 256, part.view(torch.uint8).shape,
                                                   generator=gen, dtype=torch.uint8))  # fmt: skip
    before = [part.clone() for part in dev.parts]
    dev.touch(1, 4)
    dev.touch(0, P)
    for part, old in zip(dev.parts, before, strict=True):
        assert torch.equal(part.view(torch.uint8), old.view(torch.uint8))
    assert dev.page_bytes() * P == dev.nbytes()
