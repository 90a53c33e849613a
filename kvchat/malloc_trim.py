"""glibc's `malloc_trim`: give the heap's free pages back to the OS.

glibc keeps freed blocks in its arenas for reuse and returns a page to the OS only from
the top of an arena, so memory freed below a block still in use stays resident. Loading
a model frees a lot of it (the prepared layers read from their cache, then copied into
the huge-page arena) and the engine's long steps free their activations.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def glibc_malloc_trim() -> Callable[[], None] | None:
    """`malloc_trim(0)` of the C library this process runs on; None where there is none
    (musl, macOS, Windows: their allocators return memory on their own terms)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)
