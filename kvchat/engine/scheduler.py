"""Which sequences run in the next step, and how many tokens each.

Every step has a token budget. Running decodes take one token each first; prefill
chunks fill what is left, so a long new prompt never stops another stream for more
than one step. Admission needs a batch slot and pages; a request that does not fit
may be overtaken by later ones at most `max_skips` times, then it blocks the queue
until it fits (no starvation). When the running sequences alone exhaust the pages,
the newest is preempted: its pages go back to the cache and it is requeued first,
so its recompute is mostly a cache hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvchat.engine.cache.page_table import PageTable, Reservation
from kvchat.engine.config import EngineConfig
from kvchat.engine.request import RequestState
from kvchat.engine.sequence import Sequence
from kvchat.engine.step_pacer import MIN_PREFILL_TOKENS, StepKind, StepPacer

BESIDE_NEW_PROMPTS = MIN_PREFILL_TOKENS  # tokens of prefills under way in a step admitting


@dataclass
class StepPlan:
    runs: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to feed)
    admitted: list[tuple[Sequence, Reservation]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    decodes: int = 0  # runs that are one decode token each

    @property
    def empty(self) -> bool:
        return not self.runs

    @property
    def kind(self) -> StepKind:
        if self.decodes == len(self.runs):
            return StepKind.DECODE
        return StepKind.MIXED if self.decodes else StepKind.PREFILL


class Scheduler:
    def __init__(self, config: EngineConfig, table: PageTable):
        self.config = config
        self.table = table
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.preemptions = 0
        self.pacer = StepPacer(config.mixed_step_slowdown, config.prefill_step_s)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or cancelled sequence, releasing its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.table.release(seq.id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def requeue(self, seq: Sequence) -> None:
        """Give a long generation's pages back to the cache and let the queue move."""
        self.running.remove(seq)
        self.table.release(seq.id)
        seq.num_computed = 0
        seq.state = RequestState.QUEUED
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.step_token_budget
        # 1. decodes first: one token each, preempting the newest when pages run out
        for seq in list(self.running):
            if seq not in self.running or seq.to_compute != 1:
                continue
            while not self.table.ensure_capacity(seq.id, len(seq.tokens) + 1):
                victim = self._newest_except(seq, plan)
                self._preempt(victim or seq, plan)
                if victim is None:
                    break
            if seq in self.running:
                plan.runs.append((seq, 1))
                budget -= 1
        plan.decodes = len(plan.runs)
        # Streams are running: a long prompt gets small chunks, so their latency stays bounded.
        decoding = bool(plan.runs)
        if decoding:
            paced = int(self.config.prefill_tokens_while_decoding * self.pacer.scale)
            budget = min(budget, max(self.config.min_prefill_chunk, paced))
        else:  # no stream: bounded in time, for a prompt that arrives meanwhile
            budget = self.pacer.prefill_tokens(budget)
        # 2. prefills already under way continue in admission order; while prompts wait,
        #    with a small share only: the step that admits a prompt ends in its first
        #    token, so a question from another session neither waits for the rest of a
        #    long prompt nor for a long step beside it
        share = min(budget // 2, BESIDE_NEW_PROMPTS) if self.waiting else budget
        held = budget - share
        budget = share
        continuing: list[int] = []  # their places in plan.runs
        for seq in self.running:
            if budget <= 0:
                break
            if seq.to_compute > 1:
                n = min(seq.to_compute, budget, self._chunk_cap(seq, decoding))
                continuing.append(len(plan.runs))
                plan.runs.append((seq, n))
                budget -= n
        budget += held
        # 3. admit new requests while budget and batch slots last
        blocked: Sequence | None = None
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_batch:
                break
            if blocked is not None and blocked.skipped >= self.config.max_skips:
                break  # the head has been overtaken enough: wait for it to fit
            count_as = "recompute" if seq.admitted else "prompt"
            reservation = self.table.reserve(seq.id, seq.tokens, count_as=count_as)
            if reservation is None:
                if blocked is None:
                    blocked = seq
                continue
            if blocked is not None:
                blocked.skipped += 1
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.num_computed = reservation.to_compute_from
            seq.since_admission = 0
            plan.admitted.append((seq, reservation))
            n = min(seq.to_compute, budget, self._chunk_cap(seq, decoding))
            plan.runs.append((seq, n))
            budget -= n
        # 4. nothing admitted (no pages or slots yet): the share held goes back
        for place in continuing if not plan.admitted else ():
            if budget <= 0:
                break
            seq, n = plan.runs[place]
            more = min(seq.to_compute, n + budget, self._chunk_cap(seq, decoding)) - n
            if more > 0:
                plan.runs[place] = (seq, n + more)
                budget -= more
        return plan

    def _chunk_cap(self, seq: Sequence, decoding: bool) -> int:
        """The largest prefill chunk for `seq` this step.

        Beside running streams, a chunk's attention costs its length times the context
        it attends to, so at a long context the same chunk takes several times longer
        than at the start of the prompt; the cap shrinks with the context (down to
        `min_prefill_chunk`) to keep every mixed step, not just the early ones, short.
        The pacer scales it to what this machine does in the time allowed.
        """
        if not decoding:
            return self.config.step_token_budget  # (the step's budget bounds it)
        allowed = self.config.prefill_work_while_decoding * self.pacer.scale
        work = int(allowed) // max(1, seq.num_computed)
        return max(self.config.min_prefill_chunk, work)

    def unfittable(self) -> Sequence | None:
        """A waiting request that can never fit: nothing runs and it still cannot be reserved."""
        if self.running or not self.waiting:
            return None
        return self.waiting[0]

    def _newest_except(self, keep: Sequence, plan: StepPlan) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not keep:
                return seq
        return None

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.table.release(seq.id)
        plan.runs = [(s, n) for s, n in plan.runs if s is not seq]
        seq.num_computed = 0
        seq.state = RequestState.PREEMPTED
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        self.preemptions += 1
