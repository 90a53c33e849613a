"""Drafts: prompts computed ahead while the user is still typing them (type-ahead prefill).

A draft is a prefill-only request at the lowest priority. It produces no tokens and
holds no pages between steps: each step that runs one reserves the draft's prefix up
to the end of its chunk, computes the chunk, and releases it again (`release`), so its
full pages join the prompt cache like any prompt's and its last partial page stays
cached for reuse by copy. A draft therefore never stands in the way of a request:
it cannot be preempted because it holds nothing, and the submitted turn's walk finds
its pages as it finds any cached prefix (a token that tokenized differently once more
text followed is where the match stops and compute begins).

When a draft runs (`DraftQueue.plan`): never while a submitted prompt is waiting or
prefilling (their time to first token comes first); beside decodes only in chunks the
`DraftPacer` allows (the streams' latency); on an otherwise idle engine with the whole
step budget, as fast as a prompt. One draft a step, oldest first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.draft_pacer import DraftPacer
from kvchat.engine.events import DraftProgress

log = logging.getLogger(__name__)


class Draft:
    """One draft's bookkeeping (engine thread only): K/V exist for `tokens[:num_computed]`."""

    __slots__ = ("id", "measured", "num_computed", "on_progress", "tokens")

    def __init__(
        self, draft_id: int, tokens: tuple[int, ...], on_progress: Callable[[DraftProgress], None]
    ) -> None:
        self.id = draft_id
        self.tokens = tokens
        self.on_progress = on_progress
        self.num_computed = 0
        self.measured = False  # what the cache already holds has been looked up

    @property
    def done(self) -> bool:
        return self.num_computed >= len(self.tokens)

    def report(self) -> None:
        self.on_progress(
            DraftProgress(self.id, self.num_computed, len(self.tokens), time.monotonic())
        )


@dataclass(frozen=True)
class DraftRun:
    """A draft chunk planned into a step: feed `tokens[start:start + n]`, then release."""

    draft: Draft
    start: int
    n: int


class DraftQueue:
    """The live drafts, and which one (if any) runs in the next step."""

    def __init__(self, step_token_budget: int) -> None:
        self.step_token_budget = step_token_budget
        self.pacer = DraftPacer()
        self._drafts: dict[int, Draft] = {}

    def __len__(self) -> int:
        return len(self._drafts)

    def add(self, draft: Draft) -> None:
        self._drafts[draft.id] = draft

    def cancel(self, draft_id: int) -> bool:
        """Drop a draft (its computed pages stay cached); False if it is not one."""
        return self._drafts.pop(draft_id, None) is not None

    def plan(
        self,
        table: PageTable,
        *,
        prompts_pending: bool,
        decodes: int,
        slots_free: int,
        decode_step_s: float | None,
        idle_budget: int | None = None,
    ) -> DraftRun | None:
        """Reserve the next draft chunk in `table`, or None when no draft may run now."""
        if prompts_pending or not self._drafts or slots_free <= 0:
            return None
        idle = self.step_token_budget if idle_budget is None else idle_budget
        budget = self.pacer.chunk(decode_step_s) if decodes else idle
        if budget <= 0:
            return None
        for draft in list(self._drafts.values()):
            if not draft.measured:  # skip what the cache already holds (another turn, a draft)
                draft.measured = True
                draft.num_computed = table.residency(draft.tokens).device
                draft.report()
            if draft.done:
                del self._drafts[draft.id]
                continue
            end = min(len(draft.tokens), draft.num_computed + budget)
            reservation = table.reserve(draft.id, draft.tokens[:end], count_as="draft")
            if reservation is None:
                return None  # no room even for a chunk: try again next step
            # pages evicted since the last chunk are computed again, within the budget
            start = reservation.to_compute_from
            draft.num_computed = start
            return DraftRun(draft, start, min(end - start, budget))
        return None

    def finish_step(self, run: DraftRun, table: PageTable) -> None:
        """After the forward: record the chunk's K/V and give the pages back to the cache."""
        draft = run.draft
        table.commit(draft.id, draft.tokens[run.start : run.start + run.n])
        table.release(draft.id)
        draft.num_computed = run.start + run.n
        if draft.done:
            self._drafts.pop(draft.id, None)
        draft.report()

    def release_all(self, table: PageTable) -> None:
        """After an engine error: no draft may stay reserved in the table."""
        for draft in self._drafts.values():
            if table.is_live(draft.id):
                table.release(draft.id)

    def abort_step(self, run: DraftRun, table: PageTable) -> None:
        """The forward failed: release the reservation, drop the draft (it was only a guess)."""
        if table.is_live(run.draft.id):
            table.release(run.draft.id)
        self._drafts.pop(run.draft.id, None)
        log.warning("a draft's forward pass failed; the draft was dropped")
