"""The physical KV store: device pages, host slots, and the copies between them.

The page table decides which page holds what; this module holds the bytes. K and
V are each ONE tensor over all layers, `[num_layers, num_pages, page_size,
n_kv_heads, head_dim]`, so moving a page across every layer is a single indexing
copy (one for K, one for V) instead of one per layer, and `k(layer)` is a plain
view `[num_pages, page_size, n_kv_heads, head_dim]` for the attention.

The host store is slot-major, `[num_slots, num_layers, page_size, n_kv_heads,
head_dim]`, so a slot is one contiguous block: the device-to-host copy of a page
lands in one DMA-friendly region. On CUDA it is pinned, which lets both
directions run with `non_blocking=True` on a side stream (`copy_stream.py`) that
the compute waits for before its next forward (`wait_for_copies`), so the CPU
never waits for them; only a CPU reader of host bytes must call `synchronize()`.
On a CPU device the host store is still a separate tensor pool, so the two tiers
behave alike and the tests exercise the same copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.engine.cache.window_slots import WindowSlots
from kvchat.engine.layer_groups import LayerGroups
from kvchat.engine.tiers.copy_stream import CopyStream
from kvchat.model import huge_pages
from kvchat.model.gated_deltanet import DeltaNetState

KV_FORMATS = ("native", "int8")


def kv_bytes_per_token(
    num_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_format: str = "native"
) -> int:
    """Bytes of K and V one token occupies across all layers.

    int8 stores one byte per value plus one scale (in the compute dtype) per token
    and head: (D + itemsize) instead of D * itemsize, ~1.9x the tokens per byte.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_head = head_dim + itemsize if kv_format == "int8" else head_dim * itemsize
    return 2 * num_layers * n_kv_heads * per_head


def pages_for_bytes(
    nbytes: int,
    num_layers: int,
    page_size: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_format: str = "native",
) -> int:
    """How many whole pages (or host slots) fit in `nbytes` (0 when not even one fits)."""
    per_page = page_size * kv_bytes_per_token(num_layers, n_kv_heads, head_dim, dtype, kv_format)
    return max(0, nbytes // per_page)


def _check_format(kv_format: str) -> None:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"unknown KV format {kv_format!r}; use one of {KV_FORMATS}")


class DeviceKVStore:
    """The device pool: K and V for every layer and page (only page 0 zero-initialized).

    With `kv_format="int8"`, `k_all`/`v_all` hold int8 codes and `k_scale_all`/
    `v_scale_all` `[L, P, S, Hkv]` one scale per token and head (in `dtype`).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_format: str = "native",
    ) -> None:
        _check_format(kv_format)
        shape = (num_layers, num_pages, page_size, n_kv_heads, head_dim)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_format = kv_format
        self.compute_dtype = dtype
        store_dtype = torch.int8 if kv_format == "int8" else dtype

        # `empty`, not `zeros`: zeroing gigabytes at start costs seconds of page faults and
        # commits RAM no page uses yet. Unwritten slots are never read (a context is read up
        # to its length only) except padding in batched decode, which reads slot 0 of page 0
        # and masks it: page 0 is zeroed so even that read is of finite numbers. On a CPU
        # the store asks for huge pages: a long-context decode streams it like the weights.
        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if torch.device(device).type == "cpu":
                return huge_pages.empty(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=device)

        self.k_all = allocate(shape, store_dtype)  # [L, P, S, Hkv, D]
        self.v_all = allocate(shape, store_dtype)
        self.k_scale_all: torch.Tensor | None = None
        self.v_scale_all: torch.Tensor | None = None
        if kv_format == "int8":
            self.k_scale_all = allocate(shape[:-1], dtype)  # [L, P, S, Hkv]
            self.v_scale_all = allocate(shape[:-1], dtype)
        for part in self.parts:
            part[:, 0].zero_()

    @property
    def parts(self) -> list[torch.Tensor]:
        """Every tensor a page owns a slice of (page axis 1): what a page copy must move."""
        scales = [self.k_scale_all, self.v_scale_all] if self.k_scale_all is not None else []
        return [self.k_all, self.v_all, *scales]

    @property
    def device(self) -> torch.device:
        return self.k_all.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_all.dtype

    def k(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys, a view `[num_pages, page_size, n_kv_heads, head_dim]`."""
        return self.k_all[layer]

    def v(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s values, a view `[num_pages, page_size, n_kv_heads, head_dim]`."""
        return self.v_all[layer]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def page_bytes(self) -> int:
        """Bytes one page holds across every layer and tensor."""
        return self.nbytes() // self.num_pages

    def touch(self, first: int, last: int) -> None:
        """Fault in the memory of pages [first, last) without changing a byte.

        Why: the store is allocated empty (see `__init__`), so the OS maps its memory at
        the first write, in the middle of a prefill; in 2 MiB pages that can include
        compacting memory to find one (measured: docs/kv-cache.md). So an idle engine
        touches its whole store, a slice a step, within seconds of launch, committing the
        RAM the device cache was sized to.
        Every 4 KiB is read and written back (adding zero), so live pages keep their
        contents; only the engine's thread, which is the only writer, calls this.
        """
        if self.device.type != "cpu" or first >= last:
            return
        for part in self.parts:
            for layer in range(self.num_layers):
                fault_in(part[layer, first:last])


def fault_in(region: torch.Tensor) -> None:
    """Make the OS map a CPU tensor's memory now, keeping its bytes: one byte every 4 KiB
    is read and written back (zero added). Only a tensor's sole writer may call this."""
    region.reshape(-1).view(torch.uint8)[::4096].add_(0)


class HostKVStore:
    """Host slots for evicted full pages, in CPU memory (pinned when the device is CUDA)."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        page_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        for_device: torch.device | str = "cpu",
        kv_format: str = "native",
    ) -> None:
        _check_format(kv_format)
        shape = (num_slots, num_layers, page_size, n_kv_heads, head_dim)
        pin = torch.device(for_device).type == "cuda"
        self.num_slots = num_slots
        self.pinned = pin
        self.kv_format = kv_format
        store_dtype = torch.int8 if kv_format == "int8" else dtype
        # only full pages are ever copied in, so nothing unwritten is read: `empty` suffices
        self.k_all = torch.empty(shape, dtype=store_dtype, pin_memory=pin)  # [slots, L, S, Hkv, D]
        self.v_all = torch.empty(shape, dtype=store_dtype, pin_memory=pin)
        self.k_scale_all: torch.Tensor | None = None
        self.v_scale_all: torch.Tensor | None = None
        if kv_format == "int8":
            self.k_scale_all = torch.empty(shape[:-1], dtype=dtype, pin_memory=pin)
            self.v_scale_all = torch.empty(shape[:-1], dtype=dtype, pin_memory=pin)

    @property
    def parts(self) -> list[torch.Tensor]:
        """The same tensors as the device store's `parts`, slot axis first."""
        scales = [self.k_scale_all, self.v_scale_all] if self.k_scale_all is not None else []
        return [self.k_all, self.v_all, *scales]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)


@dataclass(frozen=True)
class StateLayout:
    """A hybrid model's linear-layer state as the disk tier stores it: the stacked conv
    and recurrent shapes, and the conv's dtype (the recurrent one is float32)."""

    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    dtype: torch.dtype


class KVPageMover:
    """The page table's `PageMover` over real tensors: one copy per tensor per operation.

    With a windowed store (`layer_groups`), a page's windowed layers live in that store at
    the slot `window_slots` gives the page, or nowhere (the part was let go). The host and
    disk tiers keep every layer in the model's order (a snapshot has zeros where a page had
    no window part, a host slot whatever it held before) and a flag that says whether it
    had (`window_of_host`, `window_of_parts`).
    """

    def __init__(
        self,
        device_store: DeviceKVStore,
        host_store: HostKVStore | None,
        window_store: DeviceKVStore | None = None,
        groups: LayerGroups | None = None,
        window_slots: WindowSlots | None = None,
        states: StateLayout | None = None,
    ) -> None:
        self.states = states  # a hybrid model's: how a kept state becomes disk parts
        self.device_store = device_store
        self.host_store = host_store
        self.window_store = window_store
        self._async = device_store.device.type == "cuda" and (
            host_store is None or host_store.pinned
        )
        # host-tier copies on a side stream where there are streams (copy_stream.py)
        self._side = CopyStream(device_store.device) if self._async else None
        self._full_layers: list[int] | None = None  # model layer of each store layer
        self._window_layers: list[int] | None = None
        if window_store is not None:
            if groups is None or not groups.split or window_slots is None:
                raise ValueError("a windowed store needs its layer groups and window slots")
            self._full_layers = list(groups.full)
            self._window_layers = list(groups.windowed)
        self._slots = window_slots
        layers = device_store.num_layers + (window_store.num_layers if window_store else 0)
        # which host slots hold their page's window part
        self._host_window = torch.zeros(host_store.num_slots if host_store else 0, dtype=torch.bool)
        if host_store is not None:
            for d, h in zip(device_store.parts, host_store.parts, strict=True):
                if h.dtype != d.dtype or h.shape[1:] != (layers, *d.shape[2:]):
                    raise ValueError(
                        f"host store {tuple(h.shape)} {h.dtype} does not match "
                        f"device store {tuple(d.shape)} {d.dtype} of {layers} layers"
                    )
            if len(device_store.parts) != len(host_store.parts):
                raise ValueError("host and device stores hold different KV formats")

    def window_slot_of(self, device_page: int) -> int | None:
        """Where the page's windowed layers are (None: nowhere, or no windowed store)."""
        return self._slots.slot(device_page) if self._slots is not None else None

    def window_of_host(self, host_slot: int) -> bool:
        return bool(self._host_window[host_slot])

    def window_of_parts(self, parts: list[torch.Tensor]) -> bool:
        """Whether a page read from disk (`snapshot_*` layout) holds its window part."""
        return self.window_store is not None and bool(parts[-1][0])

    def _flag(self, kept: bool) -> list[torch.Tensor]:
        """The flag part a snapshot ends with, where a windowed store is apart."""
        if self.window_store is None:
            return []
        return [torch.tensor([int(kept)], dtype=torch.uint8)]

    def _host(self) -> HostKVStore:
        if self.host_store is None:
            raise RuntimeError("this mover has no host store")
        return self.host_store

    def _copying(self):
        return self._side.copies() if self._side is not None else contextlib.nullcontext()

    def _window_parts(self) -> list[torch.Tensor]:
        return self.window_store.parts if self.window_store is not None else []

    def device_to_host(self, device_page: int, host_slot: int) -> None:
        # [L, S, Hkv, D] (strided across layers on the device) -> one contiguous host slot
        with self._copying():
            if self._full_layers is None:
                for d, h in zip(self.device_store.parts, self._host().parts, strict=True):
                    h[host_slot].copy_(d[:, device_page], non_blocking=self._async)
                return
            ws = self.window_slot_of(device_page)
            self._host_window[host_slot] = ws is not None
            for (store, layers), (_, index) in zip(
                self._groups(), self._group_layers(ws, device_page), strict=True
            ):
                if index is None:
                    continue
                for part, h in zip(store.parts, self._host().parts, strict=True):
                    for i, layer in enumerate(layers):
                        h[host_slot, layer].copy_(part[i, index], non_blocking=self._async)

    def host_to_device(self, host_slot: int, device_page: int) -> None:
        with self._copying():
            if self._full_layers is None:
                for d, h in zip(self.device_store.parts, self._host().parts, strict=True):
                    d[:, device_page].copy_(h[host_slot], non_blocking=self._async)
                return
            parts = [h[host_slot] for h in self._host().parts]
            self.load_device([*parts, *self._flag(self.window_of_host(host_slot))], device_page)

    def _groups(self) -> list[tuple[DeviceKVStore, list[int]]]:
        """Each store with the model layers it holds, in its order."""
        assert self.window_store is not None
        assert self._full_layers is not None and self._window_layers is not None
        return [
            (self.device_store, self._full_layers),
            (self.window_store, self._window_layers),
        ]

    def _group_layers(self, window_slot: int | None, device_page: int):
        """Where a page lives in each store: (store, its index there, or None)."""
        return [(self.device_store, device_page), (self.window_store, window_slot)]

    def wait_for_copies(self) -> None:
        """Order the compute after the host-tier copies issued so far: before a forward
        pass, and before a device copy that may touch a restored page."""
        if self._side is not None:
            self._side.wait()

    def snapshot_device(self, device_page: int) -> list[torch.Tensor]:
        """CPU copies of a device page's tensors `[L, S, ...]` (every layer, in the model's
        order: zeros for a window part let go), for the disk tier's writer."""
        if self._full_layers is None:
            return [
                d[:, device_page].to("cpu", copy=True).contiguous() for d in self.device_store.parts
            ]
        ws = self.window_slot_of(device_page)
        layers = len(self._full_layers) + len(self._window_layers or ())
        out = [torch.zeros((layers, *d.shape[2:]), dtype=d.dtype) for d in self.device_store.parts]
        for (store, model_layers), (_, index) in zip(
            self._groups(), self._group_layers(ws, device_page), strict=True
        ):
            if index is None:
                continue
            for part, page in zip(store.parts, out, strict=True):
                for i, layer in enumerate(model_layers):
                    page[layer].copy_(part[i, index])
        return [*out, *self._flag(ws is not None)]

    def snapshot_host(self, host_slot: int) -> list[torch.Tensor]:
        """Copies of a host slot's tensors (the slot is about to be reused)."""
        self.synchronize()  # an asynchronous device-to-host copy may still be filling it
        parts = [h[host_slot].clone() for h in self._host().parts]
        return [*parts, *self._flag(self.window_of_host(host_slot))]

    def load_device(self, parts: list[torch.Tensor], device_page: int) -> None:
        """Copy a page read from disk or the host (`snapshot_*` layout) into a device page."""
        self.wait_for_copies()  # an eviction's copy may still read the page or slot it reuses
        if self._full_layers is None:
            for d, t in zip(self.device_store.parts, parts, strict=True):
                d[:, device_page].copy_(t)
            return
        ws = self.window_slot_of(device_page) if self.window_of_parts(parts) else None
        for (store, model_layers), (_, index) in zip(
            self._groups(), self._group_layers(ws, device_page), strict=True
        ):
            if index is None:
                continue
            for part, t in zip(store.parts, parts, strict=False):  # not the flag
                for i, layer in enumerate(model_layers):
                    part[i, index].copy_(t[layer], non_blocking=self._async)

    def copy_tokens(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        # [L, n, ...]: the first n slots of the page, every layer
        self.wait_for_copies()
        for d in self.device_store.parts:
            d[:, dst_page, :n_tokens] = d[:, src_page, :n_tokens]
        src, dst = self.window_slot_of(src_page), self.window_slot_of(dst_page)
        if src is not None and dst is not None:
            for w in self._window_parts():
                w[:, dst, :n_tokens] = w[:, src, :n_tokens]

    def move_page(self, src_page: int, dst_page: int) -> None:
        self.wait_for_copies()
        for d in self.device_store.parts:
            d[:, dst_page] = d[:, src_page]
        src, dst = self.window_slot_of(src_page), self.window_slot_of(dst_page)
        if src is not None and dst is not None:
            for w in self._window_parts():
                w[:, dst] = w[:, src]

    def state_parts(self, state: Sequence[DeltaNetState] | None) -> list[torch.Tensor]:
        """A hybrid model's state kept at a page's end as the disk page's parts (CPU
        tensors, stacked over the linear layers; for none, empty ones and a 0 flag: a
        real model's state is megabytes, more than a page's K/V)."""
        layout = self.states
        assert layout is not None, "this model keeps no states"
        conv_shape, recurrent_shape = layout.shapes
        if state is None:
            return [
                torch.zeros((0, *conv_shape[1:]), dtype=layout.dtype),
                torch.zeros((0, *recurrent_shape[1:]), dtype=torch.float32),
                torch.zeros(1, dtype=torch.uint8),
            ]
        return [
            torch.stack([s.conv for s in state]).cpu(),
            torch.stack([s.recurrent for s in state]).float().cpu(),
            torch.ones(1, dtype=torch.uint8),
        ]

    def state_from_parts(self, parts: list[torch.Tensor]) -> tuple[DeltaNetState, ...] | None:
        """The state a disk page's last parts hold (`state_parts`), on the device; None."""
        conv, recurrent, kept = parts
        if not bool(kept[0]):
            return None
        device = self.device_store.device
        return tuple(
            DeltaNetState(c.to(device), r.to(device))
            for c, r in zip(conv.unbind(0), recurrent.unbind(0), strict=True)
        )

    def state_to_host(self, state: Sequence[DeltaNetState]) -> tuple[DeltaNetState, ...]:
        """A state whose page moves to the host tier, in host memory: on a GPU it would
        otherwise hold device memory the host tier exists to free (on a CPU the host is
        the device, and the state is kept as it is: a kept state is never written)."""
        if self.device_store.device.type == "cpu":
            return tuple(state)
        return tuple(DeltaNetState(s.conv.cpu(), s.recurrent.cpu()) for s in state)

    def state_to_device(self, state: Sequence[DeltaNetState]) -> tuple[DeltaNetState, ...]:
        """A host-tier state (`state_to_host`) where the model computes."""
        device = self.device_store.device
        if device.type == "cpu":
            return tuple(state)
        return tuple(DeltaNetState(s.conv.to(device), s.recurrent.to(device)) for s in state)

    def synchronize(self) -> None:
        """Wait for pending asynchronous copies (before the CPU reads host bytes)."""
        if self._async:
            torch.cuda.synchronize(self.device_store.device)
