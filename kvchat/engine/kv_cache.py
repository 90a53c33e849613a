"""The KV cache an engine runs on, built from the model and the engine's settings: the
device store and its page table, the host and disk tiers behind it, and the root salt
that names its pages.

Sizes become pages here (`pages_for_bytes`), and a device cache of fewer than two pages
is refused with what to change. The salt holds everything that makes two caches' keys
differ for the same tokens: the model's weights, the dtype, the KV format and, for
LongRoPE models, the frequency set the context selects (`Transformer.fit_context`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvchat.engine.cache.page_hash import root_salt
from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.cache.state_snapshots import StateSnapshots
from kvchat.engine.cache.window_slots import WindowSlots
from kvchat.engine.config import EngineConfig, default_cache_bytes
from kvchat.engine.layer_groups import LayerGroups
from kvchat.engine.tiers.disk_page import DiskPageFormat
from kvchat.engine.tiers.disk_tier import DiskTier
from kvchat.engine.tiers.host_tier import HostTier
from kvchat.engine.tiers.kv_store import (
    DeviceKVStore,
    HostKVStore,
    KVPageMover,
    StateLayout,
    kv_bytes_per_token,
    pages_for_bytes,
)
from kvchat.errors import KvchatError
from kvchat.model.device import dtype_name

# Window slots a device page is given, for a model whose windowed layers are kept apart:
# a conversation of four windows' length keeps its last window's parts, and the rest
# goes to more pages (its full-attention layers).
WINDOW_SLOTS_PER_PAGE = 0.25


# A hybrid model's states kept at page ends: this share of the device cache (a real
# Qwen3.5's state is tens of MB), and at least this many (a few conversations' ends)
STATE_SHARE = 0.1
MIN_STATES = 4


@dataclass(frozen=True)
class KVCache:
    store: DeviceKVStore  # the full-attention layers' (every layer's, unless split)
    window_store: DeviceKVStore | None  # the windowed layers', where `groups.split`
    groups: LayerGroups
    host_store: HostKVStore | None
    mover: KVPageMover
    disk: DiskTier | None
    table: PageTable


def build_kv_cache(
    model,
    config: EngineConfig,
    context: int,
    busy: Callable[[], bool],
    *,
    split_windowed: bool = True,
) -> KVCache:
    """The cache for `model` (a `LoadedModel`) running contexts of up to `context`
    tokens; `busy` tells the disk tier's writer when requests run (it holds back then).
    `split_windowed`: keep windowed layers apart (`layer_groups`)."""
    mc, transformer = model.config, model.transformer
    device, dtype = transformer.device, transformer.dtype
    default_dev, default_host = default_cache_bytes(device)
    dev_bytes = config.device_cache_bytes or default_dev
    host_bytes = default_host if config.host_cache_bytes is None else config.host_cache_bytes
    ps, kv_format = config.page_size, config.kv_format
    # a hybrid model's linear layers keep a state per sequence, not K/V (`sequence_states`),
    # and the table keeps states at page ends (`state_snapshots`), which go with their
    # pages to the host and disk tiers
    hybrid = mc.kv_layers != mc.num_layers
    states, host_states = None, None
    if hybrid:
        states = _state_snapshots(mc, dtype, dev_bytes)
        dev_bytes -= states.capacity * states.state_bytes
        # the host tier keeps states of its own pages in host memory (`LowerTiers`), sized
        # from its budget by the device's rule (none where two would not fit)
        host_states = 0
        if host_bytes >= 2 * states.state_bytes:
            host_states = _state_snapshots(mc, dtype, host_bytes).capacity
        host_bytes -= host_states * states.state_bytes
    geometry = (mc.kv_layers, ps, mc.num_kv_heads, mc.head_dim, dtype)
    groups = LayerGroups.of(mc.layer_windows if split_windowed else None, mc.kv_layers)
    num_pages = pages_for_bytes(dev_bytes, *geometry, kv_format)
    window_slots = 0
    if groups.split:
        num_pages, window_slots = _split_pool(dev_bytes, groups, config, geometry[1:])
    host_slots = pages_for_bytes(host_bytes, *geometry, kv_format)
    if num_pages < 2:
        raise KvchatError(
            f"The device cache ({dev_bytes} bytes) holds fewer than 2 pages of "
            f"{ps} tokens; raise --device-cache or lower --page-size."
        )
    window_store = window = None
    if groups.split:
        assert groups.window is not None
        rest = (ps, mc.num_kv_heads, mc.head_dim, dtype, device, kv_format)
        store = DeviceKVStore(len(groups.full), num_pages, *rest)
        window_store = DeviceKVStore(len(groups.windowed), window_slots, *rest)
        window = WindowSlots(window_slots, groups.window, ps, config.step_token_budget, num_pages)
    else:
        store = DeviceKVStore(*geometry[:1], num_pages, *geometry[1:], device, kv_format)
    host_store = HostKVStore(host_slots, *geometry, device, kv_format) if host_slots else None
    # keys rotated by another of LongRoPE's frequency sets are other keys
    rotary_set = transformer.fit_context(context)
    fingerprint = model.fingerprint + (f"-rope-{rotary_set}" if rotary_set else "")
    if groups.split:  # its disk pages carry a flag those of a store kept whole lack
        fingerprint += "-windowed-apart"
    salt = root_salt(fingerprint, dtype_name(dtype), kv_format)
    state_layout = _state_layout(mc, dtype) if hybrid else None
    mover = KVPageMover(store, host_store, window_store, groups, window, state_layout)
    disk = None
    if config.disk_cache_bytes > 0:
        from kvchat.paths import app_paths

        fmt = DiskPageFormat(
            salt,
            ps,
            mc.kv_layers,
            mc.num_kv_heads,
            mc.head_dim,
            dtype_name(dtype),
            kv_format,
            window_flag=groups.split,
            state_shapes=state_layout.shapes if state_layout is not None else None,
        )
        root = config.disk_cache_dir or app_paths().kv_cache_dir
        disk = DiskTier(root, fmt, config.disk_cache_bytes, busy=busy)
    host = HostTier(host_slots) if host_slots else None
    table = PageTable(
        num_pages, ps, salt, host, mover, disk, window, states=states, host_states=host_states
    )
    return KVCache(store, window_store, groups, host_store, mover, disk, table)


def _split_pool(
    nbytes: int, groups: LayerGroups, config: EngineConfig, geometry: tuple
) -> tuple[int, int]:
    """(pages, window slots) for a device cache of `nbytes` whose windowed layers are kept
    apart. The slots: `WINDOW_SLOTS_PER_PAGE` of the pages, and at least what a full batch
    of sequences holding their windows while a step writes its chunk needs; never more
    than a slot per page (and slot 0, never given)."""
    ps = config.page_size
    page_bytes = ps * kv_bytes_per_token(len(groups.full), *geometry[1:], config.kv_format)
    slot_bytes = ps * kv_bytes_per_token(len(groups.windowed), *geometry[1:], config.kv_format)
    if config.window_slots is not None:
        slots = config.window_slots
        return max(0, (nbytes - slots * slot_bytes) // page_bytes), slots
    assert groups.window is not None
    per_sequence = -(-(groups.window - 1) // ps) + 2
    least = 1 + (config.max_batch + 2) * per_sequence + -(-config.step_token_budget // ps) + 1
    pages = int(nbytes // (page_bytes + WINDOW_SLOTS_PER_PAGE * slot_bytes))
    if WINDOW_SLOTS_PER_PAGE * pages < least:
        pages = max(0, (nbytes - least * slot_bytes) // page_bytes)
    slots = max(least, int(WINDOW_SLOTS_PER_PAGE * pages))
    if slots > pages + 1:  # a slot for every page: the pages take the rest
        per_page = page_bytes + slot_bytes
        pages = max(0, (nbytes - slot_bytes) // per_page)
        slots = pages + 1
    return pages, slots


def _state_snapshots(mc, dtype, nbytes: int) -> StateSnapshots:
    """The states a hybrid model's table keeps at page ends: `STATE_SHARE` of the device
    cache, and at least `MIN_STATES` where that leaves the pages half of it."""
    shape = mc.delta_net
    itemsize = torch.empty((), dtype=dtype).element_size()
    conv = (shape.conv_kernel - 1) * shape.conv_dim * itemsize
    recurrent = shape.num_v_heads * shape.head_k_dim * shape.head_v_dim * 4  # float32
    state_bytes = len(mc.linear_layers) * (conv + recurrent)
    capacity = max(MIN_STATES, int(STATE_SHARE * nbytes) // state_bytes)
    capacity = max(1, min(capacity, nbytes // 2 // state_bytes))  # pages keep half at least
    return StateSnapshots(capacity, state_bytes)


def _state_layout(mc, dtype) -> StateLayout:
    """How the disk tier stores a hybrid model's state: stacked over its linear layers."""
    shape, n = mc.delta_net, len(mc.linear_layers)
    conv = (n, shape.conv_kernel - 1, shape.conv_dim)
    recurrent = (n, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim)
    return StateLayout((conv, recurrent), dtype)
