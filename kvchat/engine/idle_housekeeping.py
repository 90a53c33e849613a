"""What the engine does with a step that has nothing to run: defragment, then fault in.

An idle engine packs the page table's cached trees into runs (`PageTable.defragment`),
a slice of pages a step, so a request that arrives meanwhile waits for one slice, not
for the whole pass (measured: docs/kv-cache.md). After that, on a CPU, it touches the
KV store's memory that no step has written yet (`DeviceKVStore.touch`), a slice a
step, so later prefills do not pay for the page faults.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.config import available_memory
from kvchat.engine.tiers.kv_store import DeviceKVStore

# Idle defragmentation moves at most this many pages a step, so a request that arrives
# meanwhile waits for one slice, not for the whole pass (measured: docs/kv-cache.md).
DEFRAG_PAGES_PER_STEP = 16
# After that, an idle step on a CPU faults in this much of the KV store that no step has
# touched yet (`DeviceKVStore.touch`), so later prefills do not pay for it.
TOUCH_BYTES_PER_STEP = 32 << 20
# Touching stops for good while less than this much RAM would be left: pages committed
# ahead of use must never push the machine into swap (they are faulted in when written).
TOUCH_RESERVE_BYTES = 1 << 30


class IdleHousekeeping:
    """Where the idle work stands: is the table packed, how much of the store is touched."""

    def __init__(self, store: DeviceKVStore) -> None:
        self.defragmented = True
        self.defragmenting = False  # a pass cut into slices is under way
        # pages below this were faulted in by idle steps (CPU stores; others need nothing)
        self.touched_pages = 0 if store.device.type == "cpu" else store.num_pages

    def work_came(self) -> None:
        """A step ran requests: the layout may have changed, the next idle pass starts afresh."""
        self.defragmented = False
        self.defragmenting = False

    def defragment_slice(self, table: PageTable, *, running: bool) -> bool:
        """Move one slice of pages into place; True when pages moved (more may be left)."""
        if running or self.defragmented:
            return False
        moved = table.defragment(max_moves=DEFRAG_PAGES_PER_STEP, resuming=self.defragmenting)
        self.defragmented = moved == 0
        self.defragmenting = moved > 0
        return moved > 0

    def next_touch(
        self, store: DeviceKVStore, available_ram: Callable[[], int] | None = None
    ) -> tuple[int, int] | None:
        """The next slice of store pages to fault in, or None when all are touched (or
        when touching more would leave less than `TOUCH_RESERVE_BYTES` of RAM)."""
        if self.touched_pages >= store.num_pages:
            return None
        per_step = max(1, TOUCH_BYTES_PER_STEP // store.page_bytes())
        free = (available_ram or _available_ram)()
        if free - per_step * store.page_bytes() < TOUCH_RESERVE_BYTES:
            self.touched_pages = store.num_pages  # the rest is faulted in when first written
            return None
        end = min(store.num_pages, self.touched_pages + per_step)
        touch = (self.touched_pages, end)
        self.touched_pages = end
        return touch


def _available_ram() -> int:
    return available_memory(torch.device("cpu"))
