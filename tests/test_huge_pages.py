"""Hot CPU tensors in 2 MiB pages: the helpers place and copy exactly, the model's linear
layers end up in one arena, and the KV store asks for huge pages too."""

from __future__ import annotations

import sys

import pytest
import torch

from kvchat.engine.tiers.kv_store import DeviceKVStore
from kvchat.model import huge_pages
from kvchat.model.linear import StackedLinear, slot_names
from kvchat.model.loader import load_model

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


@linux
def test_large_tensors_start_on_a_huge_page_boundary():
    t = huge_pages.empty((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert float(t.float().sum()) == 1.5 * t.numel()


def test_small_tensors_are_plain():
    t = huge_pages.empty((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.dtype == torch.float32


class _Holder:
    pass


def test_move_into_arena_copies_bytes_into_one_arena():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(300, 7, generator=g).to(torch.bfloat16),
        torch.randint(-127, 128, (1 << 21,), generator=g, dtype=torch.int8),
        torch.randint(0, 255, (5, 3), generator=g, dtype=torch.uint8),
        torch.randn(0),
    ]
    holders = []
    for t in tensors:
        holder = _Holder()
        holder.t = t
        holders.append(holder)
    assert huge_pages.move_into_arena([(h, "t") for h in holders])
    storages = {h.t.untyped_storage().data_ptr() for h in holders}
    assert len(storages) == 1
    for original, holder in zip(tensors, holders, strict=True):
        assert holder.t is not original
        assert holder.t.dtype == original.dtype and holder.t.shape == original.shape
        assert torch.equal(holder.t, original)
        assert holder.t.data_ptr() % huge_pages.ALIGN == 0


def test_an_arena_too_large_for_free_memory_is_not_made(monkeypatch):
    monkeypatch.setattr(huge_pages, "_available_memory", lambda: 1 << 20)
    holder = _Holder()
    holder.t = original = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB > half of 1 MiB
    assert not huge_pages.move_into_arena([(holder, "t")])
    assert holder.t is original


def test_the_models_linear_layers_share_one_arena(tmp_path):
    from tests.tiny_models import write_tiny_model

    model = load_model(str(write_tiny_model(tmp_path / "m", "llama")), dtype="float32")
    t = model.transformer
    storages = set()
    for linear in t._linears():
        for name in slot_names(type(linear)):
            x = getattr(linear, name, None)
            if isinstance(x, torch.Tensor) and x.data_ptr() != t.embed.data_ptr():
                storages.add(x.untyped_storage().data_ptr())
    assert len(storages) == 1


def test_a_stacked_layers_parts_join_the_arena_and_the_weight_count(tmp_path):
    """A Q4_K_M file's q/k/v is a stack of a 4-bit q/k and a Q6_K v: their tensors are
    copied into the arena with every other layer's, and counted in the weight bytes (the
    embedding table too, which is the tied Q6_K head's codes, not a dense table)."""
    from tests.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M")
    t = load_model(str(path), dtype="float32", device="cpu").transformer
    stack = t.layers[0].qkv
    assert isinstance(stack, StackedLinear)
    arena = t.layers[0].gate_up.codes.untyped_storage().data_ptr()
    for part in stack.parts:
        assert part.codes.untyped_storage().data_ptr() == arena
    held = sum(linear.nbytes() for linear in t._linears())
    assert held >= sum(layer.qkv.nbytes() for layer in t.layers)
    assert t.embed_codes is t.lm_head
    rotary = sum(x.numel() * x.element_size() for x in t.rotary_tensors())
    assert (
        held + rotary <= t.weight_bytes() < held + rotary + t.embed.numel() * t.embed.element_size()
    )


@linux
def test_a_cpu_kv_store_asks_for_huge_pages():
    store = DeviceKVStore(
        4, 256, 16, 2, 64, torch.bfloat16, torch.device("cpu"), "native"
    )  # 4 MiB each
    assert store.k_all.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert store.v_all.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert bool((store.k_all[:, 0] == 0).all())  # page 0 still zeroed
