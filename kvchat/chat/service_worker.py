"""`ServiceWorker`: the session service's one worker thread and its task queue.

Why one thread: engine events arrive on the engine thread and commands on any
thread, but applying events, publishing them and writing SQLite happen here,
one task after another, so a reply is stored before it is announced and a
turn's start (started on the planner's thread, `turn_planner.py`) is announced
after the reply before it ended and before its own reply's events. While the
database refuses writes the worker wakes every `RETRY_SAVE_S` to try again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kvchat.chat")

RETRY_SAVE_S = 2.0  # while the database refuses writes, try again this often

Task = Callable[[], None]


class ServiceWorker:
    """Runs queued tasks in order on its own thread; `retry` runs while `retrying()`."""

    def __init__(self, retry: Task, retrying: Callable[[], bool]) -> None:
        self._retry = retry
        self._retrying = retrying
        self._tasks: queue.Queue[Task | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="kvchat-sessions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: Task) -> None:
        """Run `task` after every task queued before it (safe from any thread)."""
        self._tasks.put(task)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every task queued so far has run."""
        done = threading.Event()
        self._tasks.put(done.set)
        return done.wait(timeout)

    def stop(self, timeout: float | None) -> None:
        """Run what is queued, then end the thread."""
        self._tasks.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=RETRY_SAVE_S if self._retrying() else None)
            except queue.Empty:
                task = self._retry
            if task is None:
                return
            try:
                task()
            except Exception:  # a bug: log it, keep serving the other sessions
                log.exception("session worker task failed")
