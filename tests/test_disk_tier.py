"""The disk tier on its own: page files round-trip, every faulty file is refused and removed,
writes are atomic and user-only, the index survives a restart from names alone, and the
writer stays out of a busy engine's way."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from kvchat.engine.cache.page_hash import page_hash, root_salt
from kvchat.engine.tiers import disk_page
from kvchat.engine.tiers.disk_index import DiskEntry, DiskIndex
from kvchat.engine.tiers.disk_page import DiskPageFormat, page_path, read_page
from kvchat.engine.tiers.disk_tier import DiskTier, clear_folder, folder_usage
from kvchat.engine.tiers.disk_writer import BackgroundWriter

L, S, H, D = 3, 4, 2, 8
SALT = root_salt("disk-test-model", "bfloat16", "native")
FMT = DiskPageFormat(SALT, S, L, H, D, "bfloat16", "native")
FMT8 = DiskPageFormat(
    root_salt("disk-test-model", "bfloat16", "int8"), S, L, H, D, "bfloat16", "int8"
)


def random_parts(fmt: DiskPageFormat, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in fmt.part_names:
        shape, dtype = fmt.part_shape(name), fmt.part_dtype(name)
        if dtype == torch.int8:
            out.append(torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8))
        else:
            out.append(torch.randn(shape, generator=gen).to(dtype))
    return out


def chain(n: int, salt: bytes = SALT, start: int = 0) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
    """n consecutive pages: (hash, parent, tokens)."""
    out = []
    parent = salt
    for i in range(n):
        tokens = tuple(range(start + i * S, start + (i + 1) * S))
        h = page_hash(parent, tokens)
        out.append((h, parent, tokens))
        parent = h
    return out


def make_tier(root: Path, fmt: DiskPageFormat = FMT, capacity: int = 1 << 30, **kw) -> DiskTier:
    return DiskTier(root, fmt, capacity, **kw)


def saved(root: Path, fmt: DiskPageFormat = FMT, n: int = 2) -> tuple[list, list]:
    tier = make_tier(root, fmt)
    pages = chain(n, fmt.salt)
    parts = [random_parts(fmt, i) for i in range(n)]
    for (h, parent, tokens), p in zip(pages, parts, strict=True):
        assert tier.save(h, parent, tokens, p)
    tier.close()
    return pages, parts


@pytest.mark.parametrize("fmt", [FMT, FMT8], ids=["bf16", "int8"])
def test_page_round_trips_through_a_file_bit_exact(tmp_path: Path, fmt: DiskPageFormat) -> None:
    pages, parts = saved(tmp_path, fmt)
    tier = make_tier(tmp_path, fmt)  # a restart: found from the folder alone
    for (h, _parent, _tokens), want in zip(pages, parts, strict=True):
        assert h in tier
        got = tier.load(h)
        assert got is not None
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert tier.stats().pages == 2
    assert tier.problems() == []
    tier.close()


def test_files_are_named_by_parent_and_hash_and_readable_by_the_user_only(tmp_path: Path) -> None:
    pages, _ = saved(tmp_path)
    for h, parent, _tokens in pages:
        path = page_path(tmp_path, SALT, parent, h)
        assert path == tmp_path / SALT.hex() / parent.hex() / f"{h.hex()}.safetensors"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_queued_page_is_served_before_its_file_exists(tmp_path: Path) -> None:
    busy = threading.Event()
    busy.set()  # the writer holds back while the engine is busy
    tier = make_tier(tmp_path, busy=busy.is_set)
    (h, parent, tokens) = chain(1)[0]
    parts = random_parts(FMT, 0)
    tier.save(h, parent, tokens, parts)
    assert h in tier
    got = tier.load(h)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, parts, strict=True))
    assert not page_path(tmp_path, SALT, parent, h).exists()
    busy.clear()
    assert tier.flush(timeout=30)
    assert page_path(tmp_path, SALT, parent, h).exists()
    tier.close()


def _fault(tmp_path: Path, damage) -> tuple[DiskTier, bytes, Path]:
    pages, _ = saved(tmp_path, n=1)
    h, parent, _tokens = pages[0]
    path = page_path(tmp_path, SALT, parent, h)
    damage(path)
    return make_tier(tmp_path), h, path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the tensor bytes (the header comes first)
    path.write_bytes(bytes(data))


def _garbage_header(path: Path) -> None:
    path.write_bytes(b"\xff" * 64)


@pytest.mark.parametrize(
    "damage",
    [_truncate, _flip_tensor_byte, _garbage_header],
    ids=["truncated", "corrupt-tensor", "bad-header"],
)
def test_a_damaged_file_is_removed_logged_and_never_served(tmp_path, damage, caplog) -> None:
    tier, h, path = _fault(tmp_path, damage)
    assert h in tier  # indexed from its name: the tensors are only read on load
    with caplog.at_level(logging.WARNING, logger="kvchat.engine.tiers.disk_tier"):
        assert tier.load(h) is None
    assert not path.exists()
    assert h not in tier
    assert tier.stats().invalid == 1
    assert len([r for r in caplog.records if "removed page file" in r.message]) == 1
    tier.close()


def test_a_page_of_another_model_at_this_name_is_refused(tmp_path: Path, caplog) -> None:
    other = DiskPageFormat(
        root_salt("other-model", "bfloat16", "native"), S, L, H, D, "bfloat16", "native"
    )
    (h, parent, tokens) = chain(1)[0]
    path = page_path(tmp_path, SALT, parent, h)
    disk_page.write_file_atomically(
        path, disk_page.encode_page(other, h, parent, tokens, random_parts(other, 0))
    )
    tier = make_tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvchat.engine.tiers.disk_tier"):
        assert tier.load(h) is None
    assert not path.exists() and tier.stats().invalid == 1
    assert any("salt" in r.message for r in caplog.records)
    tier.close()


@pytest.mark.parametrize("field", ["FORMAT_VERSION", "KV_NUMERICS_VERSION"])
def test_a_page_of_another_format_version_is_refused(tmp_path, monkeypatch, field) -> None:
    monkeypatch.setattr(disk_page, field, getattr(disk_page, field) + 1)
    pages, _ = saved(tmp_path, n=1)  # written by a "newer" kvchat
    monkeypatch.undo()
    h, parent, _tokens = pages[0]
    tier = make_tier(tmp_path)
    assert tier.load(h) is None
    assert not page_path(tmp_path, SALT, parent, h).exists()
    assert tier.stats().invalid == 1
    tier.close()


def test_read_page_names_the_mismatch(tmp_path: Path) -> None:
    pages, _ = saved(tmp_path, n=1)
    h, parent, _tokens = pages[0]
    wider = DiskPageFormat(SALT, S, L, H + 1, D, "bfloat16", "native")
    with pytest.raises(disk_page.DiskPageInvalid, match="geometry"):
        read_page(page_path(tmp_path, SALT, parent, h), wider, h, parent)


def test_a_vanished_file_is_a_miss_not_a_fault(tmp_path: Path, caplog) -> None:
    tier, h, _path = _fault(tmp_path, lambda p: p.unlink())
    with caplog.at_level(logging.WARNING):
        assert tier.load(h) is None
    assert tier.stats().invalid == 0 and not caplog.records
    assert h not in tier
    tier.close()


def test_a_full_disk_stops_writes_with_one_notice(tmp_path, monkeypatch, caplog) -> None:
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvchat.engine.tiers.disk_tier.write_file_atomically", full)
    tier = make_tier(tmp_path)
    pages = chain(3)
    with caplog.at_level(logging.WARNING, logger="kvchat.engine.tiers.disk_tier"):
        tier.save(*pages[0], random_parts(FMT, 0))
        tier.flush(timeout=30)
        assert not tier.save(*pages[1], random_parts(FMT, 1))  # refused at once from now on
        assert not tier.save(*pages[2], random_parts(FMT, 2))
        tier.flush(timeout=30)
    notice = tier.stats().notice
    assert notice is not None and "No space left" in notice
    assert len([r for r in caplog.records if "cannot be written" in r.message]) == 1
    assert pages[0][0] not in tier  # what was queued is given up, not served from memory forever
    tier.close()


def test_an_unwritable_folder_stops_writes_and_reads_go_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    tier = make_tier(blocker / "kv")  # cannot be created: a file is in the way
    (h, parent, tokens) = chain(1)[0]
    assert tier.stats().notice is not None
    assert not tier.save(h, parent, tokens, random_parts(FMT, 0))
    assert tier.load(h) is None
    tier.close()


def test_a_file_appears_only_whole_under_its_name(tmp_path, monkeypatch) -> None:
    """Two processes share the folder: the final name must never name a partial file."""
    seen: list[tuple[bool, int]] = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((Path(dst).exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(disk_page.os, "replace", spy)
    (h, parent, tokens) = chain(1)[0]
    data = disk_page.encode_page(FMT, h, parent, tokens, random_parts(FMT, 0))
    path = page_path(tmp_path, SALT, parent, h)
    disk_page.write_file_atomically(path, data)
    assert seen == [(False, len(data))]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left over


def test_leftover_temporary_files_of_dead_processes_are_removed_at_start(tmp_path: Path) -> None:
    pages, _ = saved(tmp_path, n=1)
    h, parent, _tokens = pages[0]
    folder = page_path(tmp_path, SALT, parent, h).parent
    dead = folder / f".{h.hex()}.999999999.abcd1234.tmp"  # no such process
    live = folder / f".{h.hex()}.{os.getpid()}.abcd1234.tmp"  # a write in flight
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    make_tier(tmp_path).close()
    assert not dead.exists() and live.exists()


def test_the_index_at_start_reads_names_and_times_only(tmp_path: Path) -> None:
    pages, _ = saved(tmp_path, n=3)
    for i, (h, parent, _tokens) in enumerate(pages):
        path = page_path(tmp_path, SALT, parent, h)
        path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # broken, but unread at start
        os.utime(path, (1000 + i, 1000 + i))
    tier = make_tier(tmp_path)
    assert all(h in tier for h, _p, _t in pages) and tier.stats().invalid == 0
    entries = {e.hash: e for e in tier.index.entries()}
    assert entries[pages[0][0]].parent == SALT and entries[pages[2][0]].parent == pages[1][0]
    assert entries[pages[0][0]].last_used == 1000
    tier.close()


def test_capacity_drops_the_least_recently_used_tree_deepest_first(tmp_path: Path) -> None:
    page_file = len(disk_page.encode_page(FMT, *chain(1)[0], random_parts(FMT, 0)))
    tier = make_tier(tmp_path, capacity=4 * page_file + 64)  # token ids differ in length
    old = chain(2, start=0)
    new = chain(2, start=100)
    for i, page in enumerate(old + new):
        tier.save(*page, random_parts(FMT, i))
        tier.flush(timeout=30)
    tier.touch(new[0][0], when=4e9)  # the second conversation was used later
    extra = chain(1, start=500)[0]
    tier.save(*extra, random_parts(FMT, 9))
    tier.flush(timeout=30)
    assert old[1][0] not in tier  # the old tree's leaf went first
    assert all(h in tier for h in (old[0][0], new[0][0], new[1][0], extra[0]))
    assert tier.stats().dropped == 1
    assert not page_path(tmp_path, SALT, old[1][1], old[1][0]).exists()
    assert tier.problems() == []
    tier.close()


def test_index_eviction_order_orphans_then_lru_trees_leaf_first() -> None:
    index = DiskIndex(10_000)
    a = chain(3, start=0)
    b = chain(2, start=100)
    for i, (h, parent, _t) in enumerate(a):
        index.add(DiskEntry(h, SALT, parent, 10, 50.0 + i))
    for i, (h, parent, _t) in enumerate(b):
        index.add(DiskEntry(h, SALT, parent, 10, 10.0 + i))
    orphan = chain(2, start=200)[1]  # its parent is not indexed and is not a salt
    index.add(DiskEntry(orphan[0], SALT, orphan[1], 10, 99.0))
    assert index.eviction_order() == [orphan[0], b[1][0], b[0][0], a[2][0], a[1][0], a[0][0]]
    assert index.victims(index.capacity_bytes - index.used_bytes) == []
    assert index.victims(index.capacity_bytes - index.used_bytes + 15) == [orphan[0], b[1][0]]
    assert index.problems() == []


def test_folder_usage_and_clear(tmp_path: Path) -> None:
    saved(tmp_path, n=2)
    saved(tmp_path, FMT8, n=1)
    usage = folder_usage(tmp_path)
    assert (usage.pages, usage.models) == (3, 2) and usage.bytes > 0
    assert clear_folder(tmp_path).pages == 3
    assert folder_usage(tmp_path).pages == 0


def test_writer_waits_while_busy_and_close_flushes_what_is_pending() -> None:
    polls = threading.Semaphore(0)

    def busy() -> bool:
        polls.release()
        return True

    ran: list[int] = []
    writer = BackgroundWriter(busy, backlog_limit=1 << 30)
    writer.submit(lambda: ran.append(1), nbytes=10)
    for _ in range(3):  # the writer looked three times and held back each time
        assert polls.acquire(timeout=30)
    assert ran == []
    assert writer.close(timeout=30) == 0
    assert ran == [1]


def test_writer_starts_only_after_the_engine_has_been_idle_for_the_grace() -> None:
    """A job queued as a turn ends must not start in the gap before the next turn."""
    busy = threading.Event()
    busy.set()
    ran_at: list[float] = []
    done = threading.Event()

    def job() -> None:
        ran_at.append(time.monotonic())
        done.set()

    writer = BackgroundWriter(busy.is_set, backlog_limit=1 << 30, idle_grace_s=0.5)
    writer.submit(job, nbytes=10)
    idle_at = time.monotonic()
    busy.clear()
    assert done.wait(timeout=30)
    assert ran_at[0] - idle_at >= 0.5
    writer.close(timeout=1)


def test_a_long_idle_before_the_job_arrived_does_not_count_as_grace() -> None:
    """The writer sleeps while it has nothing to do, so it cannot know the engine stayed idle."""
    done = threading.Event()
    ran_at: list[float] = []
    writer = BackgroundWriter(lambda: False, backlog_limit=1 << 30, idle_grace_s=0.5)
    first = threading.Event()
    writer.submit(first.set)
    assert first.wait(timeout=30)
    time.sleep(0.6)  # longer than the grace, with nothing queued
    submitted = time.monotonic()
    writer.submit(lambda: (ran_at.append(time.monotonic()), done.set()))
    assert done.wait(timeout=30)
    assert ran_at[0] - submitted >= 0.5
    writer.close(timeout=1)


def test_writer_ignores_busy_when_its_backlog_passes_the_limit() -> None:
    done = threading.Event()
    writer = BackgroundWriter(lambda: True, backlog_limit=100)
    writer.submit(done.set, nbytes=101)
    assert done.wait(timeout=30)
    writer.close(timeout=1)


def test_a_hybrid_models_page_keeps_its_state_or_an_empty_one(tmp_path: Path) -> None:
    """A hybrid model's page file ends with the linear layers' state kept at the page's
    end, or with empty parts and a 0 flag (a real state is megabytes: not written as zeros)."""
    shapes = ((2, 3, 5), (2, 4, 6, 6))
    fmt = DiskPageFormat(SALT, S, L, H, D, "bfloat16", "native", state_shapes=shapes)
    kv = [torch.randn(L, S, H, D).to(torch.bfloat16) for _ in range(2)]
    state = [torch.randn(shapes[0]).to(torch.bfloat16), torch.randn(shapes[1])]
    tokens = tuple(range(S))
    empty = [torch.zeros(0, 3, 5, dtype=torch.bfloat16), torch.zeros(0, 4, 6, 6)]
    with_state = [*kv, *state, torch.ones(1, dtype=torch.uint8)]
    without = [*kv, *empty, torch.zeros(1, dtype=torch.uint8)]
    for n, parts in enumerate((with_state, without)):
        parent = page_hash(SALT, (n,) * S)
        h = page_hash(parent, tokens)
        path = page_path(tmp_path, SALT, parent, h)
        disk_page.write_file_atomically(path, disk_page.encode_page(fmt, h, parent, tokens, parts))
        _, read = read_page(path, fmt, h, parent)
        assert all(torch.equal(a, b) for a, b in zip(read, parts, strict=True))
    assert path.stat().st_size < 2 * sum(t.numel() * t.element_size() for t in kv)
