"""Fakes for the page table's disk tier: a mover with snapshots, and an in-memory disk.

The fake mover's "K/V" are the token prefixes each slot holds (see `page_table_helpers`),
so a page read back from the fake disk can be checked against the hash that names it.
"""

from __future__ import annotations

from typing import Any

from tests.page_table_helpers import FakeMover, WindowFakeMover


class DiskMover(FakeMover):
    """FakeMover plus the disk tier's copies (a page's data is its slots' prefixes)."""

    def snapshot_device(self, device_page: int) -> Any:
        self.calls.append(("snap-d", device_page, -1))
        return list(self.dev[device_page])

    def snapshot_host(self, host_slot: int) -> Any:
        self.calls.append(("snap-h", host_slot, -1))
        return list(self.host[host_slot])

    def load_device(self, parts: Any, device_page: int) -> None:
        self.calls.append(("load", -1, device_page))
        self.dev[device_page] = list(parts)


class WindowDiskMover(WindowFakeMover):
    """`WindowFakeMover` plus the disk tier's copies: a page's data is its slots' prefixes
    and its window part's (None where the page had none), as the real mover's flag says."""

    def snapshot_device(self, device_page: int) -> Any:
        self.calls.append(("snap-d", device_page, -1))
        ws = self.window.slot(device_page)
        return list(self.dev[device_page]), None if ws is None else list(self.win[ws])

    def snapshot_host(self, host_slot: int) -> Any:
        self.calls.append(("snap-h", host_slot, -1))
        part = self.host_win[host_slot]
        return list(self.host[host_slot]), None if part is None else list(part)

    def load_device(self, parts: Any, device_page: int) -> None:
        self.calls.append(("load", -1, device_page))
        full, part = parts
        self.dev[device_page] = list(full)
        ws = self.window.slot(device_page)
        if ws is not None and part is not None:
            self.win[ws] = list(part)

    def window_of_parts(self, parts: Any) -> bool:
        return parts[1] is not None


class FakeDisk:
    """An in-memory `DiskStore`; `broken` hashes fail their checks once when loaded."""

    def __init__(self, capacity: int | None = None) -> None:
        self.pages: dict[bytes, tuple[bytes, tuple[int, ...], Any]] = {}
        self.capacity = capacity  # pages; None: unbounded
        self.broken: set[bytes] = set()
        self.loads = 0
        self.touched: list[bytes] = []
        self.refuse = False  # as after a full disk: nothing more is written

    def __contains__(self, h: object) -> bool:
        return h in self.pages

    def save(
        self, h: bytes, parent: bytes, tokens: tuple[int, ...], parts: Any, *, replace: bool = False
    ) -> bool:
        if self.refuse or (self.capacity is not None and len(self.pages) >= self.capacity):
            return False
        self.pages[h] = (parent, tokens, list(parts))
        return True

    def load(self, h: bytes) -> Any | None:
        self.loads += 1
        if h in self.broken:  # removed, as the real tier removes a file that fails a check
            self.broken.discard(h)
            del self.pages[h]
            return None
        entry = self.pages.get(h)
        return None if entry is None else list(entry[2])

    def touch(self, h: bytes) -> None:
        self.touched.append(h)

    def problems(self) -> list[str]:
        return []
