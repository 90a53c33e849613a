"""`TurnPlanner`: the one thread that sizes turns, outside the service's lock.

Sizing a turn's prompt (`plan_prompt`) calls the renderer, which for a server is
HTTP (/apply-template, /tokenize): never under the service's lock, where a slow
server would stall every other session's events and every query of the UI, and
never on the caller's thread, so a caller (the TUI's UI thread) submits and
returns. One thread keeps turns sized in the order they were submitted; each
result is handed to the service's worker, which starts the turn.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

Job = Callable[[], None]


class TurnPlanner:
    """Runs sizing jobs in order on its own thread (`kvchat-plan`)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="kvchat-plan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def plan(self, job: Job) -> None:
        """Run `job` after every job handed over before it (safe from any thread)."""
        self._jobs.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job handed over so far has run."""
        done = threading.Event()
        self._jobs.put(done.set)
        return done.wait(timeout)

    def stop(self, timeout: float | None) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()  # a job reports its own failures (the turn fails, the next ones go on)
