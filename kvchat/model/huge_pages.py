"""Large, hot CPU tensors in 2 MiB pages (Linux transparent huge pages).

Why: a decode step streams every weight (about 90 MB for the default model) and, at long
contexts, as many bytes of K/V. In 4 KiB pages that is tens of thousands of TLB misses
a step; in 2 MiB pages a few dozen. Linux backs anonymous memory with huge pages either
always or only where a program asks (`madvise(MADV_HUGEPAGE)`: "madvise" is a common
default), and a request counts for memory not yet touched. So these helpers allocate,
ask, and only then write (measured with `benchmarks/experiments/huge_pages_ab.py`: docs/kernels.md).

Best effort everywhere: off Linux, with THP turned off, or if `madvise` refuses, the
tensors are ordinary ones with the same contents.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # each tensor in an arena starts on a cache line


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of `nbytes`, in huge pages where the OS grants
    them (from 2 MiB up; smaller ones are plain). Its address is 2 MiB-aligned when large."""
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    if madvise(raw.data_ptr() + start, length, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
    return raw[start : start + nbytes]


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(shape, dtype=dtype)` on the CPU, in huge pages where granted."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for size in shape:
        count *= size
    return empty_bytes(count * itemsize).view(dtype).view(tuple(shape))


def move_into_arena(places: Sequence[tuple[object, str]]) -> bool:
    """Replace each contiguous CPU tensor `obj.name` with a copy of it, all of them back to
    back in one arena of huge pages. One at a time: each original is dropped as soon as
    its copy exists, so memory grows only by what something else still holds. Skipped
    (False) when the arena would need more than half the memory available now: a large
    model must load where it loaded before."""
    sizes = []
    for obj, name in places:
        t = getattr(obj, name)
        sizes.append((t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN)
    total = sum(sizes)
    available = _available_memory()
    if available is not None and total > available // 2:
        log.info("weights (%d MB) stay in ordinary pages: too large to copy now", total >> 20)
        return False
    arena = empty_bytes(total)
    at = 0
    for (obj, name), size in zip(places, sizes, strict=True):
        t = getattr(obj, name)
        nbytes = t.numel() * t.element_size()
        copy = arena[at : at + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        setattr(obj, name, copy)
        at += size
    return True


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
