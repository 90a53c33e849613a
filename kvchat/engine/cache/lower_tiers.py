"""The tiers below the device, as the page table uses them: the host tier and the disk tier.

Why one object: every place the table met a lower tier (admission restoring pages,
eviction keeping them, release saving them, a host slot being reused) used to ask
"is there a host tier? a disk tier? is the page there already?" on its own, so the
rules for where a page goes lived in five methods. Here they live once: a page
leaving the device goes to the host tier, else (no host room) to disk, else it is
dropped; a page leaving the host goes to disk first unless it is there already.

This object moves bytes through the table's `PageMover` and counts evictions through
the callback the table gives it; the table keeps the page records and the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Protocol

from kvchat.engine.cache.cache_counters import EvictionKind
from kvchat.engine.tiers.host_tier import HostPage, HostTier


class PageMover(Protocol):
    """Moves K/V bytes when the table says so; `kv_store.KVPageMover` is the real one."""

    def device_to_host(self, device_page: int, host_slot: int) -> None: ...

    def host_to_device(self, host_slot: int, device_page: int) -> None: ...

    def copy_tokens(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        """Copy the first `n_tokens` slots of `src_page` into `dst_page`."""
        ...

    def move_page(self, src_page: int, dst_page: int) -> None: ...

    # the disk tier's side: a page's K/V as opaque CPU data (tensors for the real mover)
    def snapshot_device(self, device_page: int) -> Any: ...

    def snapshot_host(self, host_slot: int) -> Any: ...

    def load_device(self, parts: Any, device_page: int) -> None: ...

    # a hybrid model: the state kept at a page's end as the disk page's last parts
    def state_parts(self, state: Any) -> Any: ...

    def state_from_parts(self, parts: Any) -> Any: ...

    # ... and kept by the host tier in host memory, given back on the device
    def state_to_host(self, state: Any) -> Any: ...

    def state_to_device(self, state: Any) -> Any: ...

    # a model whose windowed layers are kept apart: whether a copy holds their part
    def window_of_host(self, host_slot: int) -> bool: ...

    def window_of_parts(self, parts: Any) -> bool: ...


class DiskStore(Protocol):
    """The disk tier as the page table uses it (`disk_tier.DiskTier` is the real one)."""

    def __contains__(self, h: object) -> bool: ...

    def save(
        self, h: bytes, parent: bytes, tokens: tuple[int, ...], parts: Any, *, replace: bool = False
    ) -> bool:
        """Keep page `h` (queued, written in the background); False if it cannot be kept.
        A page already kept stays as it is, unless `replace`."""
        ...

    def load(self, h: bytes) -> Any | None:
        """Page `h`'s data, or None when it cannot be served (vanished, or failed a check)."""
        ...

    def touch(self, h: bytes) -> None: ...

    def problems(self) -> list[str]: ...


STATE_PART_COUNT = 3  # a hybrid model's disk page ends with its state (`disk_page.STATE_PARTS`)


class LowerTiers:
    """The host tier and the disk tier (either may be off) behind one set of lookups and moves."""

    def __init__(
        self,
        host: HostTier | None,
        disk: DiskStore | None,
        mover: PageMover,
        *,
        anchored: Callable[[bytes], bool],
        count: Callable[[EvictionKind], None],
        window_of: Callable[[int], bool] | None = None,
        state_of: Callable[[int], Any] | None = None,
        states_capacity: int = 0,
    ) -> None:
        self.host = host
        self.disk = disk
        self._mover = mover
        self._anchored = anchored  # whether a hash outside the host still leads to the root
        self._count = count
        # whether a device page holds its windowed layers' part (None: no windowed store)
        self._window_of = window_of
        # pages this process wrote to disk without their part: a copy with it replaces them
        self._partless_on_disk: set[bytes] = set()
        # a hybrid model: the linear layers' state kept at a device page's end (None: none),
        # and those of host pages, by hash, at most `states_capacity`, oldest use first
        self._state_of = state_of
        self.states_capacity = states_capacity
        self.host_states: OrderedDict[bytes, Any] = OrderedDict()

    # ---- lookups -------------------------------------------------------------------------

    def on_host(self, h: bytes) -> bool:
        return self.host is not None and h in self.host

    def state_on_host(self, h: bytes) -> Any:
        """The linear layers' state host page `h` left the device with, back on the
        device (None: none)."""
        state = self.host_states.get(h)
        if state is None:
            return None
        self.host_states.move_to_end(h)
        return self._mover.state_to_device(state)

    def has_state_on_host(self, h: bytes) -> bool:
        return h in self.host_states

    def _keep_host_state(self, h: bytes, device_page: int) -> None:
        state = self._state_of(device_page) if self._state_of is not None else None
        if state is None:
            return
        self.host_states[h] = self._mover.state_to_host(state)
        self.host_states.move_to_end(h)
        while len(self.host_states) > self.states_capacity:
            self.host_states.popitem(last=False)

    def window_on_host(self, h: bytes) -> bool:
        """Whether host page `h` holds its windowed layers' part (it left the device with it)."""
        entry = self.host.get(h) if self.host is not None else None
        return entry is not None and self._mover.window_of_host(entry.slot)

    def read_disk_only(self, hashes: Collection[bytes]) -> dict[bytes, Any] | None:
        """Read the pages among `hashes` that only the disk holds (the host serves the others).

        None when one failed its checks: the disk tier removed it, so a new lookup ends there.
        """
        out: dict[bytes, Any] = {}
        if self.disk is None:
            return out
        for h in hashes:
            if not self.on_host(h):
                parts = self.disk.load(h)
                if parts is None:
                    return None
                out[h] = parts
        return out

    # ---- bringing pages back -------------------------------------------------------------

    def restore_from_host(self, h: bytes, device_page: int, clock: int) -> HostPage:
        """Copy host page `h` into `device_page`; returns its entry (parent and tokens)."""
        assert self.host is not None
        entry = self.host.get(h)
        assert entry is not None
        self._mover.host_to_device(entry.slot, device_page)
        self.host.touch(h, clock)
        return entry

    def restore_from_disk(self, parts: Any, device_page: int) -> None:
        """Copy a page read from disk (`read_disk_only`) into `device_page`."""
        kv = parts[:-STATE_PART_COUNT] if self._state_of is not None else parts
        self._mover.load_device(kv, device_page)

    def state_in_parts(self, parts: Any) -> Any:
        """The state a page read from disk was kept with (None: none, or no states)."""
        if self._state_of is None:
            return None
        return self._mover.state_from_parts(parts[-STATE_PART_COUNT:])

    # ---- keeping pages that leave the device ---------------------------------------------

    def keep(
        self,
        h: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        device_page: int,
        last_used: int,
        protect: Collection[bytes],
    ) -> None:
        """A full indexed page leaves the device: to the host tier, else to disk, else dropped.

        `protect` are host pages that must not make room now (the table is restoring them).
        """
        if self.host is not None:
            if h in self.host:
                self.host.touch(h, last_used)  # already there: no copy needed
                entry = self.host.get(h)
                assert entry is not None
                gains_part = self._window_of is not None and self._window_of(device_page)
                if gains_part and not self._mover.window_of_host(entry.slot):
                    self._mover.device_to_host(device_page, entry.slot)  # now with its part
                self._keep_host_state(h, device_page)
                self._count("device_to_host")
                return
            slot = self.host.put(
                h,
                parent,
                tokens,
                last_used,
                anchored=self._anchored,
                protect=protect,
                before_drop=self._leaving_host,
            )
            if slot is not None:
                self._mover.device_to_host(device_page, slot)
                self._keep_host_state(h, device_page)
                self._count("device_to_host")
                return
        if self._keep_on_disk(
            h, parent, tokens, lambda: self._mover.snapshot_device(device_page),
            has_part=self._device_part(device_page), state=self._device_state(device_page),
        ):  # fmt: skip
            self._count("device_to_disk")
            return
        self._count("device_dropped")

    def save_released(self, pages: list[tuple[bytes, bytes, tuple[int, ...], int]]) -> None:
        """Queue the disk writes of a released sequence's full pages (hash, parent, tokens,
        device page; the chain from its root) that disk lacks."""
        if self.disk is None:
            return
        for i, (h, parent, tokens, device_page) in enumerate(pages):
            if i == 0 and h in self.disk:
                self.disk.touch(h)  # a tree's order of use is its root's
            self._keep_on_disk(
                h, parent, tokens, lambda p=device_page: self._mover.snapshot_device(p),
                has_part=self._device_part(device_page), state=self._device_state(device_page),
            )  # fmt: skip

    def _leaving_host(self, h: bytes, slot: int) -> None:
        """A host slot is about to be reused: its page goes to disk first unless already there."""
        assert self.host is not None
        entry = self.host.get(h)
        assert entry is not None
        state = self.host_states.pop(h, None)
        kept = self._keep_on_disk(
            h, entry.parent, entry.tokens, lambda: self._mover.snapshot_host(slot),
            has_part=self._window_of is not None and self._mover.window_of_host(slot),
            state=state,
        )  # fmt: skip
        self._count("host_to_disk" if kept else "host_dropped")

    def _device_part(self, device_page: int) -> bool:
        return self._window_of is not None and self._window_of(device_page)

    def _device_state(self, device_page: int) -> Any:
        return self._state_of(device_page) if self._state_of is not None else None

    def _keep_on_disk(
        self,
        h: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        snapshot: Callable[[], Any],
        *,
        has_part: bool,
        state: Any = None,
    ) -> bool:
        """Page `h` to disk unless it is there already (True: it is on disk now or queued).
        A copy this process wrote without its windowed layers' part is replaced by one
        with it: else a conversation whose window was computed again would find only the
        copy without, and compute it again at every switch."""
        if self.disk is None:
            return False
        if self._state_of is not None:  # a hybrid model's page carries its state, if kept
            kv_snapshot = snapshot

            def snapshot() -> Any:
                return [*kv_snapshot(), *self._mover.state_parts(state)]

            has_part = state is not None  # a copy without one is replaced by one with it
        if h in self.disk:
            upgrade = has_part and h in self._partless_on_disk
            if upgrade and self.disk.save(h, parent, tokens, snapshot(), replace=True):
                self._partless_on_disk.discard(h)
            return True
        kept = self.disk.save(h, parent, tokens, snapshot())
        partless = self._window_of is not None or self._state_of is not None
        if kept and partless and not has_part:
            self._partless_on_disk.add(h)
        return kept

    # ---- checking ------------------------------------------------------------------------

    def problems(self) -> list[str]:
        return self.disk.problems() if self.disk is not None else []
