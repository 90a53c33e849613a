"""The page table with a disk tier: what it saves, when, and what comes back after a restart.

A fake disk (a dict) stands in for the files and a fake mover's snapshots are the
token prefixes each slot holds, so a test can check that what a new table reads
back from "disk" is exactly the K/V its hash names (the real files are covered
in test_disk_tier.py; the real tensors end to end in test_disk_restart.py).
"""

from __future__ import annotations

import pytest

from kvchat.engine.cache.page_hash import page_hash
from kvchat.engine.cache.page_table import PageTable, PageTableCorrupt
from kvchat.engine.stats import Residency
from kvchat.engine.tiers.host_tier import HostTier
from tests.disk_helpers import DiskMover, FakeDisk
from tests.page_table_helpers import PS, SALT, assert_data, compute


def make(num_pages: int, host_slots: int | None, disk: FakeDisk) -> tuple[PageTable, DiskMover]:
    mover = DiskMover(num_pages, host_slots or 0)
    host = None if host_slots is None else HostTier(host_slots)
    return PageTable(num_pages, PS, SALT, host, mover, disk), mover


def turn(table: PageTable, mover: DiskMover, seq_id: int, tokens: list[int]):
    res = table.reserve(seq_id, tokens, count_as="prompt")
    assert res is not None
    assert_data(table, mover, seq_id, tokens)  # what came back from any tier is right
    compute(table, mover, seq_id, tokens)
    table.release(seq_id)
    table.validate()
    return res


def test_a_finished_turn_saves_its_full_pages_and_a_restart_reads_them_back() -> None:
    disk = FakeDisk()
    table, mover = make(8, 4, disk)
    history = list(range(100, 110))  # 2 full pages + 2 tokens
    turn(table, mover, 1, history)
    assert len(disk.pages) == 2  # full pages only: the partial tail never leaves the device
    table2, mover2 = make(8, 4, disk)  # a restart: nothing in memory carries over
    assert table2.residency(history) == Residency(device=0, host=0, nowhere=2, disk=8)
    res = turn(table2, mover2, 1, [*history, 7])
    assert (res.cached.disk, res.cached.device, res.cached.host) == (8, 0, 0)
    assert res.to_compute_from == 8 and res.cached_tokens == 8
    s = table2.stats()
    assert s.counters.cached_tokens.disk == 8 and s.counters.prefilled_tokens == 3
    s = table2.stats()
    assert s.counters.prompt_tokens == s.counters.cached_tokens.total + s.counters.prefilled_tokens


def test_pages_already_on_disk_are_not_written_again_and_the_root_is_touched() -> None:
    disk = FakeDisk()
    table, mover = make(8, None, disk)
    history = list(range(100, 109))
    turn(table, mover, 1, history)
    snapshots = mover.count("snap-d")
    turn(table, mover, 2, [*history, 5, 6, 7])  # one more full page
    assert mover.count("snap-d") == snapshots + 1
    assert len(disk.pages) == 3
    assert disk.touched == [page_hash(SALT, tuple(history[:PS]))]  # the tree's root, used again


def test_a_page_leaving_the_host_tier_goes_to_disk_first() -> None:
    disk = FakeDisk()
    disk.refuse = True  # nothing is saved at release: only the host's drop can write it
    table, mover = make(3, 2, disk)
    a = list(range(100, 108))
    turn(table, mover, 1, a)
    turn(table, mover, 2, list(range(200, 208)))  # a's pages go to the host
    disk.refuse = False
    turn(table, mover, 3, list(range(300, 308)))  # host full: a's pages leave it
    s = table.stats()
    assert (
        s.counters.evictions.host_to_disk >= 1
        and mover.count("snap-h") == s.counters.evictions.host_to_disk
    )
    assert s.counters.evictions.host_dropped == 0  # nothing lost entirely
    res = turn(table, mover, 4, [*a, 1])
    assert res.cached.disk + res.cached.host + res.cached.device == 8


def test_a_page_leaving_the_host_tier_with_no_disk_room_is_counted_lost() -> None:
    disk = FakeDisk()
    disk.refuse = True
    table, mover = make(3, 2, disk)
    for i in range(3):
        turn(table, mover, i, list(range(100 * i, 100 * i + 8)))
    s = table.stats()
    assert s.counters.evictions.host_to_disk == 0 and s.counters.evictions.host_dropped >= 1


def test_without_a_host_tier_an_evicted_full_page_is_kept_on_disk() -> None:
    disk = FakeDisk()
    disk.refuse = True
    table, mover = make(3, None, disk)
    a = list(range(100, 108))
    turn(table, mover, 1, a)
    disk.refuse = False
    turn(table, mover, 2, list(range(200, 208)))
    s = table.stats()
    assert s.counters.device_to_disk == 2 and s.counters.evictions.device_dropped == 0
    assert table.residency(a).disk == 8


def test_a_page_that_fails_its_checks_is_recomputed_not_served() -> None:
    disk = FakeDisk()
    table, mover = make(8, None, disk)
    history = list(range(100, 112))  # 3 full pages
    turn(table, mover, 1, history)
    table2, mover2 = make(8, None, disk)
    broken = list(disk.pages)[1]
    disk.broken.add(broken)
    res = turn(table2, mover2, 1, [*history, 1])
    assert res.cached.disk == 4  # the first page; the broken second page and after: computed
    assert broken in disk.pages  # computed again, then saved again at release
    assert table2.stats().counters.prefilled_tokens == 9


def test_switching_to_a_session_prefetches_its_disk_pages() -> None:
    disk = FakeDisk()
    table, mover = make(8, None, disk)
    history = list(range(100, 112))
    turn(table, mover, 1, history)
    table2, mover2 = make(8, None, disk)
    assert table2.prefetch(history) == 3
    assert table2.residency(history).device == 12
    table2.validate()
    res = turn(table2, mover2, 1, [*history, 1])
    assert res.cached.device == 12 and res.cached.disk == 0


def test_validate_reports_the_disk_tier_problems() -> None:
    class Broken(FakeDisk):
        def problems(self) -> list[str]:
            return ["disk: entry names another page"]

    table, _ = make(4, None, Broken())
    with pytest.raises(PageTableCorrupt, match="disk: entry"):
        table.validate()
