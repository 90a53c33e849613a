"""The CUDA side stream that copies pages between the device and the pinned host tier.

Why a stream of its own: on the compute stream a page restored from the host tier would
queue behind the step's kernels and the next step's kernels behind the copy. On a side
stream the copies overlap the compute, and the compute waits for them only when a step
is about to run (`wait`), which is when it may read the restored pages or overwrite the
ones being saved. Each batch of copies first waits for the compute stream's work so far,
so a page is saved after its last write. Only CUDA has streams: elsewhere the page
mover copies synchronously and none of this is made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CopyStream:
    """Page copies issued inside `copies()` run on a side stream; `wait()` orders the
    compute stream after them. `cuda` is `torch.cuda` (the tests pass a stand-in)."""

    def __init__(self, device: torch.device, cuda=torch.cuda) -> None:
        self.device = device
        self._cuda = cuda
        self._stream = cuda.Stream(device)
        self._pending = None  # the event after the last copies the compute has not waited for

    @contextmanager
    def copies(self) -> Iterator[None]:
        compute = self._cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the pages' last writes and reads
        with self._cuda.stream(self._stream):
            yield
        self._pending = self._stream.record_event()

    def wait(self) -> None:
        """Make the compute stream wait for the copies issued so far (no CPU wait)."""
        if self._pending is not None:
            self._cuda.current_stream(self.device).wait_event(self._pending)
            self._pending = None

    @property
    def pending(self) -> bool:
        return self._pending is not None
