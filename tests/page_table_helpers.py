"""A fake K/V mover and turn helpers for the page-table tests.

The fake mover stands in for the K/V tensors: each slot holds the whole token prefix
that produced it, so a test can check that data followed the table through every
copy, restore and move (a slot in the wrong page shows up as the wrong prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvchat.engine.cache.page_hash import page_hash, root_salt
from kvchat.engine.cache.page_table import PageTable, Reservation
from kvchat.engine.cache.window_slots import WindowSlots
from kvchat.engine.tiers.host_tier import HostTier

PS = 4


SALT = root_salt("test-model", "float32", "fp")


Slot = tuple[int, ...] | None


def chain_hash(tokens: tuple[int, ...]) -> bytes:
    """The hash naming the pages that hold `tokens` (a whole number of pages)."""
    h = SALT
    for i in range(0, len(tokens), PS):
        h = page_hash(h, tokens[i : i + PS])
    return h


class FakeMover:
    """Implements `PageMover` over lists: each slot holds the token prefix ending at it."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int = PS) -> None:
        self.ps = page_size
        self.dev: list[list[Slot]] = [[None] * page_size for _ in range(num_pages)]
        self.host: list[list[Slot]] = [[None] * page_size for _ in range(num_slots)]
        self.calls: list[tuple[str, int, int]] = []

    def device_to_host(self, device_page: int, host_slot: int) -> None:
        self.calls.append(("d2h", device_page, host_slot))
        self.host[host_slot] = list(self.dev[device_page])

    def host_to_device(self, host_slot: int, device_page: int) -> None:
        self.calls.append(("h2d", host_slot, device_page))
        self.dev[device_page] = list(self.host[host_slot])

    def copy_tokens(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        self.calls.append(("copy", src_page, dst_page))
        self.dev[dst_page][:n_tokens] = self.dev[src_page][:n_tokens]

    def move_page(self, src_page: int, dst_page: int) -> None:
        self.calls.append(("move", src_page, dst_page))
        self.dev[dst_page] = list(self.dev[src_page])

    def state_to_host(self, state: Any) -> Any:
        """A state in the host tier's memory: marked, so a test sees which copy it got."""
        return ("on host", state)

    def state_to_device(self, state: Any) -> Any:
        assert state[0] == "on host", "only a host-tier state goes back to the device"
        return state[1]

    def count(self, kind: str) -> int:
        return sum(1 for c in self.calls if c[0] == kind)


class WindowFakeMover(FakeMover):
    """`FakeMover` with the windowed layers' store: a list of slots per window slot."""

    def __init__(self, num_pages: int, num_slots: int, window: WindowSlots) -> None:
        super().__init__(num_pages, num_slots)
        self.window = window
        self.win: list[list[Slot]] = [[None] * PS for _ in range(window.num_slots)]
        self.host_win: list[list[Slot] | None] = [None] * num_slots

    def device_to_host(self, device_page: int, host_slot: int) -> None:
        super().device_to_host(device_page, host_slot)
        ws = self.window.slot(device_page)
        self.host_win[host_slot] = None if ws is None else list(self.win[ws])

    def host_to_device(self, host_slot: int, device_page: int) -> None:
        super().host_to_device(host_slot, device_page)
        ws, part = self.window.slot(device_page), self.host_win[host_slot]
        if ws is not None and part is not None:
            self.win[ws] = list(part)

    def copy_tokens(self, src_page: int, dst_page: int, n_tokens: int) -> None:
        super().copy_tokens(src_page, dst_page, n_tokens)
        src, dst = self.window.slot(src_page), self.window.slot(dst_page)
        if src is not None and dst is not None:
            self.win[dst][:n_tokens] = self.win[src][:n_tokens]

    def window_of_host(self, host_slot: int) -> bool:
        return self.host_win[host_slot] is not None


def make(
    num_pages: int, host_slots: int | None = None, salt: bytes = SALT
) -> tuple[PageTable, FakeMover]:
    mover = FakeMover(num_pages, host_slots or 0)
    host = None if host_slots is None else HostTier(host_slots)
    return PageTable(num_pages, PS, salt, host, mover), mover


def compute(table: PageTable, mover: FakeMover, seq_id: int, tokens: Sequence[int]) -> None:
    """Play the engine: write K/V ("prefixes") for tokens not yet written, then commit them."""
    start = table.num_tokens(seq_id)
    assert table.ensure_capacity(seq_id, len(tokens))
    pages = table.pages(seq_id)
    for pos in range(start, len(tokens)):
        mover.dev[pages[pos // PS]][pos % PS] = tuple(tokens[: pos + 1])
    table.commit(seq_id, tokens[start:])


def assert_data(table: PageTable, mover: FakeMover, seq_id: int, tokens: Sequence[int]) -> None:
    """The sequence's pages hold exactly the K/V of `tokens` for every written position."""
    pages = table.pages(seq_id)
    for pos in range(table.num_tokens(seq_id)):
        got = mover.dev[pages[pos // PS]][pos % PS]
        assert got == tuple(tokens[: pos + 1]), f"position {pos} of sequence {seq_id}: {got}"


def run_turn(table: PageTable, mover: FakeMover, seq_id: int, tokens: Sequence[int]) -> Reservation:
    """Admit, check the cached part, compute the rest, check all, release: one chat turn."""
    res = table.reserve(seq_id, tokens, count_as="prompt")
    assert res is not None
    assert_data(table, mover, seq_id, tokens)
    compute(table, mover, seq_id, tokens)
    assert_data(table, mover, seq_id, tokens)
    table.release(seq_id)
    table.validate()
    return res
