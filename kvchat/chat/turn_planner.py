"""`TurnPlanner`: sizes turns outside the service's lock, in submit order, and starts them.

Sizing a turn's prompt (`plan_prompt`) calls the renderer, which for a server is
HTTP (/apply-template, /tokenize): never under the service's lock, where a slow
server would stall every other session's events and every query of the UI, and
never on the caller's thread, so a caller (the TUI's UI thread) submits and
returns. One thread (`kvchat-plan`) keeps turns sized in the order they were
submitted, and starts each one itself (under the lock, briefly) as soon as it is
sized: the engine hears of a turn one thread after `say`, not two.

One exception, for a renderer that only computes (the embedded model's chat
template and tokenizer): when nothing is queued or running here, the caller may
run the job at once on its own thread (`plan(job, on_caller=True)`). That work
holds the GIL wherever it runs, so the caller's thread gains nothing by handing
it over, and the hand-over itself was the largest wait between `say` and the
prefill (docs/notes/2026-12-05-turn-hand-off-latency.md). Jobs handed over
meanwhile wait for it, so the order stays the submit order.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("kvchat.chat")

Job = Callable[[], None]


class TurnPlanner:
    """Runs sizing-and-starting jobs in submit order: on its own thread (`kvchat-plan`), or on
    the caller's when it is idle and the caller may."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._order = threading.Condition()  # guards the two counts below
        self._unfinished = 0  # jobs handed over and not finished, wherever they run
        self._on_caller = False  # a caller runs a job on its own thread now
        self._thread = threading.Thread(target=self._work, name="kvchat-plan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def plan(self, job: Job, *, on_caller: bool = False) -> Job | None:
        """Run `job` after every job handed over before it (safe from any thread).

        With `on_caller`, when no job is queued or running, `job` is returned instead:
        the caller runs it at once through `run_here`, and jobs handed over meanwhile
        wait for it. Otherwise it is queued for this thread and None is returned.
        """
        with self._order:
            self._unfinished += 1
            if on_caller and self._unfinished == 1:
                self._on_caller = True
                return job
            self._jobs.put(job)
        return None

    def run_here(self, job: Job) -> None:
        """Run on the caller's thread the job `plan` handed back; then the queue goes on."""
        try:
            self._run(job)
        finally:
            with self._order:
                self._on_caller = False
                self._order.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job handed over so far has run."""
        with self._order:
            if self._unfinished == 0:
                return True
        done = threading.Event()
        self.plan(done.set)
        return done.wait(timeout)

    def stop(self, timeout: float | None) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._order:
                self._order.wait_for(lambda: not self._on_caller)
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            job()  # a job reports its own failures (the turn fails, the next ones go on)
        except Exception:  # a bug: log it, keep sizing the other turns
            log.exception("turn planner job failed")
        finally:
            with self._order:
                self._unfinished -= 1
