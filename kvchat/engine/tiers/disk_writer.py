"""The disk tier's background thread: runs file jobs one at a time, out of the engine's way.

Why a thread of its own: encoding, checksumming and writing a page (megabytes) must
never happen inside a forward pass or on the UI thread. Why throttled: on a machine
with few cores the writer competes with the engine for CPU, so it starts a job only
once the engine has been idle for `idle_grace_s`, unless its backlog has grown past
`backlog_limit` bytes (then memory matters more than a few percent of speed). The
grace matters because a page job cannot be interrupted: a turn sent right after
another (a switch back to a conversation) would otherwise meet a job already started
in the moment between them. The thread also asks the OS for a lower priority (Linux
applies `nice` per thread).

`close(timeout)` runs what is pending until the deadline, then drops the rest: a clean
quit is bounded, and a page not written is only a page to recompute later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.05  # how often a throttled writer looks again whether the engine is idle
# how long the engine must have been idle before a job starts: longer than the gap between
# one turn's end and the next turn's submission, shorter than a person's pause
IDLE_GRACE_S = 0.3
WRITER_NICE = 10


@dataclass
class _Job:
    run: Callable[[], None]
    nbytes: int  # memory the job holds until it runs (what the backlog limit counts)


class BackgroundWriter:
    """A single worker thread for file jobs; `submit` never blocks."""

    def __init__(
        self,
        busy: Callable[[], bool] = lambda: False,
        *,
        backlog_limit: int = 256 << 20,
        idle_grace_s: float = IDLE_GRACE_S,
        name: str = "kvchat-disk",
    ) -> None:
        self._busy = busy
        self.backlog_limit = backlog_limit
        self.idle_grace_s = idle_grace_s
        self._idle_since: float | None = None  # when the writer first saw the engine idle
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._deadline: float | None = None
        self._running = False  # a job is executing now
        self.backlog_bytes = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], nbytes: int = 0) -> bool:
        """Queue a job; False (not queued) once the writer is closing."""
        with self._cond:
            if self._closing:
                return False
            self._jobs.append(_Job(run, nbytes))
            self.backlog_bytes += nbytes
            self._cond.notify_all()
        return True

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + int(self._running)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run (ignores the throttle meanwhile); True if so."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._deadline = end if end is not None else float("inf")
            self._cond.notify_all()
            try:
                while self._jobs or self._running:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._deadline = None

    def close(self, timeout: float) -> int:
        """Run pending jobs for at most `timeout` seconds, then stop; returns jobs dropped."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 1.0)
        with self._cond:
            dropped = len(self._jobs)
            self._jobs.clear()
            self.backlog_bytes = 0
        return dropped

    def _is_busy(self) -> bool:
        try:
            return bool(self._busy())
        except Exception:  # the engine is still being built: nothing runs yet
            return False

    def _quiet_long_enough(self) -> bool:
        """True once the engine has been idle for the grace period (called under the lock)."""
        now = time.monotonic()
        if self._is_busy():
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since >= self.idle_grace_s

    def _loop(self) -> None:
        # not Linux, or not allowed: the writer runs at normal priority
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            with self._cond:
                while True:
                    urgent = self._deadline is not None
                    if self._closing and (not self._jobs or time.monotonic() >= self._deadline):
                        return
                    if self._jobs and (
                        urgent
                        or self.backlog_bytes > self.backlog_limit
                        or self._quiet_long_enough()
                    ):
                        break
                    if not self._jobs:
                        self._idle_since = None  # while asleep it cannot see the engine work
                    self._cond.wait(BUSY_POLL_S if self._jobs else None)
                job = self._jobs.popleft()
                self._running = True
            try:
                job.run()
            except Exception:  # a job reports its own faults; this only keeps the thread alive
                log.exception("disk tier job failed")
            finally:
                with self._cond:
                    self._running = False
                    self.backlog_bytes -= job.nbytes
                    self._cond.notify_all()
