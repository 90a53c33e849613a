"""The disk tier of the KV cache: full pages kept as files, so a restart recomputes nothing.

The page table asks three things of it, from the engine's thread: is this page on
disk (`__contains__`), keep this page (`save`, which queues a write and returns at
once), and give me this page's K/V (`load`, a memory-mapped read checked against
the page's metadata and checksum). Files are written by a `BackgroundWriter`, never
in a forward pass or on the UI thread; a page queued for writing is already "on
disk" for lookups (it is served from its in-memory copy until the file exists).

Faults never reach the user as errors: a file that fails a check is removed and
its tokens are recomputed (one line in the error log each); a file that vanished is
a miss; a folder that cannot be written (full disk, permissions) stops writes with
one notice (`notice`, shown by the meters) while reads and serving go on.

The index (`DiskIndex`) is built at start-up from names and modification times only;
a page's time is updated when it is read or used again, so the order of last use
survives restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.engine.tiers.disk_index import DiskEntry, DiskIndex
from kvchat.engine.tiers.disk_page import (
    DIR_MODE,
    PAGE_SUFFIX,
    DiskPageFormat,
    DiskPageInvalid,
    encode_page,
    page_path,
    parse_hash,
    read_page,
    temp_owner_pid,
    write_file_atomically,
)
from kvchat.engine.tiers.disk_writer import BackgroundWriter
from kvchat.processes import pid_alive

log = logging.getLogger(__name__)

# A clean quit waits at most this long for pending writes (the rest is recomputed later).
CLOSE_TIMEOUT_S = 10.0
DEFAULT_DISK_CACHE_CAP = 8 << 30
# pages copied out for writing, in memory until written: past this the writer works even
# while requests run; past twice this new pages are not queued (they stay recomputable).
# Two 6k-token conversations of the default model queue about 290 MB.
BACKLOG_LIMIT_BYTES = 512 << 20


def free_disk_bytes(folder: Path) -> int | None:
    """Free space on the disk where `folder` lives (or would: its nearest existing
    parent); None when it cannot be read."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def default_disk_cache_bytes(folder: Path) -> int:
    """8 GiB or a tenth of the disk's free space where `folder` lives, whichever is smaller."""
    free = free_disk_bytes(folder)
    return 0 if free is None else min(DEFAULT_DISK_CACHE_CAP, free // 10)


@dataclass(frozen=True)
class DiskStats:
    """The disk tier's figures for the meters (pages of this engine's salt)."""

    capacity_bytes: int
    used_bytes: int  # every page file in the folder, all models
    pages: int  # this model's pages, written or queued
    capacity_pages: int  # pages of this model the capacity holds
    written: int  # pages written by this process
    dropped: int  # pages removed to make room (the `disk_dropped` counter)
    invalid: int  # files that failed a check and were removed
    notice: str | None  # why writes stopped, once they have


@dataclass(frozen=True)
class _Pending:
    parent: bytes
    tokens: tuple[int, ...]
    parts: list[torch.Tensor]


@dataclass(frozen=True)
class FolderUsage:
    """What `kvchat cache` reports about a disk-tier folder."""

    pages: int
    bytes: int
    models: int  # distinct salts: one per model, dtype and KV format


class DiskTier:
    """Page files under `root`, indexed by hash, written in the background."""

    def __init__(
        self,
        root: Path,
        fmt: DiskPageFormat,
        capacity_bytes: int,
        *,
        busy: Callable[[], bool] = lambda: False,
        backlog_limit: int = BACKLOG_LIMIT_BYTES,
    ) -> None:
        self.root = root
        self.fmt = fmt
        self.page_bytes = fmt.page_bytes()
        self.index = DiskIndex(capacity_bytes)
        self.notice: str | None = None
        self.written = 0
        self.dropped = 0
        self.invalid = 0
        self.backlog_limit = backlog_limit
        self._pending: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()  # guards the index, the pending pages and the counters
        try:
            root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            scan_folder(root, self.index, remove_temp=True)
        except OSError as exc:
            self._stop_writes(exc)
        self._writer = BackgroundWriter(busy, backlog_limit=backlog_limit)
        self._writer.submit(self._trim)  # the capacity may be smaller than at the last run

    # ---- the page table's side (engine thread) -------------------------------------------

    def __contains__(self, h: object) -> bool:
        with self._lock:
            return h in self._pending or h in self.index

    def save(
        self,
        h: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        parts: list[torch.Tensor],
        *,
        replace: bool = False,
    ) -> bool:
        """Queue page `h` for writing (`parts` are CPU copies); True if it is or will be on
        disk. A page on disk already stays as it is, unless `replace` (a newer copy)."""
        with self._lock:
            if h in self._pending or (h in self.index and not replace):
                return True
            if (
                self.notice is not None
                or self.page_bytes > self.index.capacity_bytes
                or self._writer.backlog_bytes > 2 * self.backlog_limit  # memory over completeness
            ):
                return False
            self._pending[h] = _Pending(parent, tokens, parts)
        return self._writer.submit(lambda: self._write(h), self.page_bytes)

    def load(self, h: bytes) -> list[torch.Tensor] | None:
        """Page `h`'s tensors (in `fmt.part_names` order), or None when it cannot be served."""
        with self._lock:
            pending = self._pending.get(h)
            if pending is not None:
                return pending.parts
            entry = self.index.get(h)
        if entry is None or entry.salt != self.fmt.salt:
            return None
        path = page_path(self.root, entry.salt, entry.parent, h)
        try:
            _tokens, parts = read_page(path, self.fmt, h, entry.parent)
        except FileNotFoundError:  # another process cleared or evicted it: a miss
            with self._lock:
                self.index.remove(h)
            return None
        except (DiskPageInvalid, OSError) as exc:
            log.warning(
                "disk cache: removed page file %s (%s); its tokens are recomputed", path, exc
            )
            with self._lock:
                self.index.remove(h)
                self.invalid += 1
            path.unlink(missing_ok=True)
            return None
        self.touch(h)
        return parts

    def touch(self, h: bytes, when: float | None = None) -> None:
        """Record a use of page `h` (in the index now, in the file's time in the background)."""
        when = time.time() if when is None else when
        with self._lock:
            entry = self.index.get(h)
            if entry is None:
                return
            self.index.touch(h, when)
            if self.notice is not None:
                return
        path = page_path(self.root, entry.salt, entry.parent, h)
        self._writer.submit(lambda: _set_mtime(path, when))

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                capacity_bytes=self.index.capacity_bytes,
                used_bytes=self.index.used_bytes,
                pages=self.index.count(self.fmt.salt) + len(self._pending),
                capacity_pages=self.index.capacity_bytes // max(self.page_bytes, 1),
                written=self.written,
                dropped=self.dropped,
                invalid=self.invalid,
                notice=self.notice,
            )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has finished; True if it did within `timeout`."""
        return self._writer.wait_idle(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Finish pending writes for at most `timeout` seconds, then stop the writer."""
        dropped = self._writer.close(timeout)
        with self._lock:
            self._pending.clear()
        if dropped:
            log.info("disk cache: %d page writes left undone at quit", dropped)

    def problems(self) -> list[str]:
        """Every broken invariant of the tier, as precise messages (empty when sound)."""
        from kvchat.engine.cache.page_hash import page_hash

        with self._lock:
            out = self.index.problems()
            for h, p in self._pending.items():
                if len(p.tokens) != self.fmt.page_size or page_hash(p.parent, p.tokens) != h:
                    out.append(f"disk: pending page {h.hex()} is keyed by a hash its tokens miss")
                shapes = [tuple(t.shape) for t in p.parts]
                want = [self.fmt.part_shape(n) for n in self.fmt.part_names]
                if shapes != want:
                    out.append(f"disk: pending page {h.hex()} has tensors {shapes}, not {want}")
            for e in self.index.entries():
                if e.salt == self.fmt.salt and e.nbytes < self.page_bytes:
                    out.append(f"disk: page {e.hash.hex()} is {e.nbytes} bytes, a page holds more")
        if self.dropped < 0 or self.written < 0 or self.invalid < 0:
            out.append("disk: a negative counter")
        return out

    # ---- the writer's side (background thread) -------------------------------------------

    def _write(self, h: bytes) -> None:
        with self._lock:
            pending = self._pending.get(h)
            if pending is None or self.notice is not None:
                self._pending.pop(h, None)
                return
        path = page_path(self.root, self.fmt.salt, pending.parent, h)
        try:
            data = encode_page(self.fmt, h, pending.parent, pending.tokens, pending.parts)
            self._make_room(len(data))
            write_file_atomically(path, data)
        except OSError as exc:
            self._stop_writes(exc)
            return
        except Exception:  # a bug, not the disk: give this page up, keep the tier going
            log.exception("disk cache: could not write page %s", h.hex())
            with self._lock:
                self._pending.pop(h, None)
            return
        entry = DiskEntry(h, self.fmt.salt, pending.parent, len(data), time.time())
        with self._lock:
            self.index.add(entry)
            self._pending.pop(h, None)
            self.written += 1

    def _make_room(self, nbytes: int) -> None:
        with self._lock:
            victims = [self.index.remove(v) for v in self.index.victims(nbytes)]
            self.dropped += len(victims)
        for entry in victims:
            if entry is not None:
                _remove_page_file(page_path(self.root, entry.salt, entry.parent, entry.hash))

    def _trim(self) -> None:
        self._make_room(0)

    def _stop_writes(self, exc: OSError) -> None:
        with self._lock:
            if self.notice is not None:
                return
            self.notice = (
                f"The disk cache folder {self.root} cannot be written ({exc.strerror or exc}); "
                "pages are no longer saved to disk. Free space or fix its permissions."
            )
            self._pending.clear()
        log.warning("disk cache: %s", self.notice)


def _set_mtime(path: Path, when: float) -> None:
    with contextlib.suppress(OSError):  # gone (evicted or cleared meanwhile): nothing to record
        os.utime(path, (when, when))


def _remove_page_file(path: Path) -> None:
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the parent's last child: keep the folder tidy
        path.parent.rmdir()


def scan_folder(root: Path, index: DiskIndex | None = None, *, remove_temp: bool = False) -> int:
    """Index every page file under `root` from names and times alone; returns files found.

    `remove_temp` deletes temporary files left by processes that are no longer running
    (a live kvchat's file in flight is left alone).
    """
    found = 0
    if not root.is_dir():
        return 0
    for salt_dir in os.scandir(root):
        salt = parse_hash(salt_dir.name)
        if salt is None or not salt_dir.is_dir(follow_symlinks=False):
            continue
        for parent_dir in os.scandir(salt_dir.path):
            parent = parse_hash(parent_dir.name)
            if parent is None or not parent_dir.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(parent_dir.path):
                pid = temp_owner_pid(f.name)
                if pid is not None:
                    if remove_temp and not pid_alive(pid):
                        Path(f.path).unlink(missing_ok=True)
                    continue
                if not f.name.endswith(PAGE_SUFFIX):
                    continue
                h = parse_hash(f.name[: -len(PAGE_SUFFIX)])
                if h is None:
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found += 1
                if index is not None:
                    index.add(DiskEntry(h, salt, parent, max(st.st_size, 1), st.st_mtime))
    return found


def folder_usage(root: Path) -> FolderUsage:
    """Pages, bytes and models in a disk-tier folder (for `kvchat cache`)."""
    index = DiskIndex(0)
    scan_folder(root, index)
    return FolderUsage(len(index), index.used_bytes, len(index.salts()))


def clear_folder(root: Path) -> FolderUsage:
    """Remove every page file under `root`; returns what was removed."""
    usage = folder_usage(root)
    if root.is_dir():
        for child in root.iterdir():
            if parse_hash(child.name) is not None and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
    return usage
