"""Which sequences run in the next step, how many tokens each, and what follows the step.

Every step has a token budget. Running decodes take one token each first; prefill
chunks fill what is left, so a long new prompt never stops another stream for more
than one step. Admission needs a batch slot and pages; a request that does not fit
may be overtaken by later ones at most `max_skips` times, then it blocks the queue
until it fits (no starvation). When the running sequences alone exhaust the pages,
the newest is preempted: its pages go back to the cache and it is requeued first,
so its recompute is mostly a cache hit.

Type-aheads (prompts computed while they are typed, `Sequence.for_type_ahead`) run at
background priority: never while a submitted prompt is waiting or prefilling (their
time to first token comes first); beside decodes only in chunks the `TypeAheadPacer`
allows (the streams' latency); on an otherwise idle engine with a prompt's step budget.
One a step, oldest first. A type-ahead holds no pages between steps: the step that
runs it reserves its prefix up to the end of its chunk, computes the chunk and
releases it again, so its full pages join the prompt cache like any prompt's and its
last partial page stays cached for reuse by copy. It therefore never stands in a
request's way: nothing to preempt, and the submitted turn's walk finds its pages as it
finds any cached prefix (a token that tokenized differently once more text followed is
where the match stops and compute begins).

After the forward (`postprocess`) the scheduler commits each run's K/V, moves its
state on, appends the sampled token (text and stop strings: `text_stream`), finishes
what ended, requeues long generations while others wait, and feeds the step's time to
the pacers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvchat.engine.cache.page_table import PageTable, Reservation
from kvchat.engine.config import EngineConfig
from kvchat.engine.events import PrefillProgress, TokenGenerated
from kvchat.engine.request import FinishReason, RequestState
from kvchat.engine.sampling import NON_FINITE_LOGITS
from kvchat.engine.sequence import Sequence
from kvchat.engine.step_pacer import MIN_PREFILL_TOKENS, StepKind, StepPacer
from kvchat.engine.text_stream import token_text
from kvchat.engine.type_ahead_pacer import TypeAheadPacer

log = logging.getLogger(__name__)

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
    def type_ahead(self) -> tuple[Sequence, int] | None:
        """The type-ahead's chunk in this step, if any (always the last run)."""
        if self.runs and self.runs[-1][0].type_ahead:
            return self.runs[-1]
        return None

    @property
    def requests(self) -> list[tuple[Sequence, int]]:
        """The runs of requests, which produce tokens: every run but a type-ahead's."""
        return self.runs[:-1] if self.type_ahead is not None else self.runs

    @property
    def kind(self) -> StepKind:
        """What the requests' runs make this step (a type-ahead's chunk is paced apart)."""
        if self.decodes == len(self.requests):
            return StepKind.DECODE
        return StepKind.MIXED if self.decodes else StepKind.PREFILL


@dataclass(frozen=True)
class StepTokens:
    """What one step computed, for the engine's rates: when it ended, and its tokens."""

    ended: float
    decode_tokens: int
    prefill_tokens: int


class Scheduler:
    def __init__(self, config: EngineConfig, table: PageTable, max_context: int):
        self.config = config
        self.table = table
        self.max_context = max_context
        self.live: dict[int, Sequence] = {}  # every sequence not finished, by id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.type_aheads: dict[int, Sequence] = {}  # oldest first; they hold no pages
        self.preemptions = 0
        self.generated_tokens = 0
        self.pacer = StepPacer(config.mixed_step_slowdown, config.prefill_step_s)
        self.type_ahead_pacer = TypeAheadPacer()

    def add(self, seq: Sequence, problem: str | None = None) -> None:
        """Take in a new sequence; one with a `problem` (invalid) finishes at once."""
        self.live[seq.id] = seq
        seq.announce_start()
        if problem is not None:
            self.finish(seq, FinishReason.ERROR, problem)
        elif seq.type_ahead:
            self.type_aheads[seq.id] = seq
        else:
            self.waiting.append(seq)

    def cancel(self, seq_id: int, *, type_ahead_only: bool = False) -> None:
        """End a live sequence (a type-ahead's computed pages stay cached)."""
        seq = self.live.get(seq_id)
        if seq is not None and (seq.type_ahead or not type_ahead_only):
            self.finish(seq, FinishReason.CANCELLED)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished or cancelled sequence, releasing its pages."""
        self.live.pop(seq.id, None)
        if seq in self.running:
            self.running.remove(seq)
            self.table.release(seq.id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif self.type_aheads.pop(seq.id, None) is not None and self.table.is_live(seq.id):
            self.table.release(seq.id)  # its step failed: nothing may stay reserved

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a sequence: a request with its `RequestFinished`; a type-ahead silently (it
        was only a guess, and its progress events said all)."""
        if seq.state == RequestState.FINISHED:
            return
        self.remove(seq)
        seq.state = RequestState.FINISHED
        if seq.type_ahead:
            if error is not None:
                log.info("type-ahead %d dropped: %s", seq.id, error)
            return
        seq.emit(seq.finished_event(reason, error, time.monotonic()))

    def fail_all(self, message: str) -> None:
        """After an engine error: every request fails, so no caller waits forever; the
        type-aheads only lose their reservations (they are retried at their next turn)."""
        try:
            for seq in self.type_aheads.values():
                if self.table.is_live(seq.id):
                    self.table.release(seq.id)
        except Exception:
            log.exception("releasing type-aheads after an engine error")
        for seq in [s for s in self.live.values() if not s.type_ahead]:
            try:
                self.finish(seq, FinishReason.ERROR, message)
            except Exception:  # the table itself may be what broke: still tell the caller
                log.exception("failing a request after an engine error")
                self.live.pop(seq.id, None)

    def request_states(self) -> dict[str, int]:
        """How many requests (type-aheads aside) are in each live state."""
        states = {s.value: 0 for s in RequestState if s != RequestState.FINISHED}
        for seq in self.live.values():
            if not seq.type_ahead and seq.state != RequestState.FINISHED:
                states[seq.state.value] += 1
        return states

    def requeue(self, seq: Sequence) -> None:
        """Give a long generation's pages back to the cache and let the queue move."""
        self.running.remove(seq)
        self.table.release(seq.id)
        seq.num_computed = 0
        seq.state = RequestState.QUEUED
        self.waiting.append(seq)

    # ---- planning --------------------------------------------------------------------------

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
            self._admitted(seq, reservation)
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
        # 5. a type-ahead's chunk, at background priority
        self._schedule_type_ahead(plan)
        return plan

    def _admitted(self, seq: Sequence, reservation: Reservation) -> None:
        """A request got its pages: where it resumes, its prompt's figures, its state."""
        seq.num_computed = reservation.to_compute_from
        seq.since_admission = 0
        if not seq.admitted:
            seq.admitted = True
            seq.cached = reservation.cached
            seq.prefilled_tokens = len(seq.tokens) - reservation.cached_tokens
            seq.type_ahead_tokens = reservation.cached_type_ahead
        else:
            seq.recomputed_tokens += len(seq.tokens) - reservation.cached_tokens
        seq.state = (
            RequestState.PREFILLING
            if seq.to_compute > 1 or not seq.generated_ids
            else RequestState.DECODING
        )

    def _schedule_type_ahead(self, plan: StepPlan) -> None:
        """Reserve the oldest type-ahead's next chunk as the plan's last run, if one may run."""
        prompts_pending = bool(self.waiting) or plan.decodes < len(plan.runs)
        slots_free = self.config.max_batch - len(self.running)
        if prompts_pending or not self.type_aheads or slots_free <= 0:
            return
        if plan.decodes:  # within the step's budget too, which the window slots are sized by
            budget = min(
                self.type_ahead_pacer.chunk(self.pacer.decode_step_s),
                self.config.step_token_budget,
            )
        else:
            budget = self.pacer.prefill_tokens(self.config.step_token_budget)
        if budget <= 0:
            return
        for seq in list(self.type_aheads.values()):
            if not seq.measured:  # skip what the cache already holds (another turn, a type-ahead)
                seq.measured = True
                seq.num_computed = self.table.residency(seq.tokens).device
                seq.report_progress()
            if seq.to_compute <= 0:
                self.finish(seq, FinishReason.STOP)
                continue
            end = min(len(seq.tokens), seq.num_computed + budget)
            hybrid = self.table.states is not None
            if hybrid and end < len(seq.tokens):
                # a hybrid model's next chunk resumes from the state at a page end, so this
                # one ends at one (a chunk ending mid-page would be computed again by the
                # next, for ever): beside streams it waits for a budget that reaches one,
                # alone it goes on to the next page end
                S = self.table.page_size
                if end // S * S > seq.num_computed:
                    end = end // S * S
                elif plan.decodes:
                    return
                else:
                    end = min(len(seq.tokens), (seq.num_computed // S + 1) * S)
            reservation = self.table.reserve(seq.id, seq.tokens[:end], count_as="type_ahead")
            if reservation is None:
                return  # no room even for a chunk: try again next step
            # pages evicted since the last chunk are computed again, within the budget (a
            # hybrid model's, up to where `end` is: it resumes from the page end before)
            seq.num_computed = reservation.to_compute_from
            n = end - seq.num_computed
            plan.runs.append((seq, n if hybrid else min(n, budget)))
            return

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

    # ---- after the forward -----------------------------------------------------------------

    def postprocess(self, plan: StepPlan, sampled: Seq[int | None], started: float) -> StepTokens:
        """Commit the step's K/V and move each run on: a prefill's progress, a request's
        sampled token (`sampled`: one per run that ended in one, None for non-finite
        logits), its finish; requeue long generations while prompts wait; then the
        type-ahead's chunk, and the step's time to the pacers (`started`: before the forward).
        """
        now = time.monotonic()
        tokens = iter(sampled)
        decode_tokens = prefill_tokens = 0
        for seq, n in plan.requests:
            start = seq.num_computed
            self.table.commit(seq.id, seq.tokens[start : start + n])
            seq.num_computed += n
            if n > 1 or not seq.generated_ids:
                prefill_tokens += n
            else:
                decode_tokens += n
            if seq.num_computed < len(seq.tokens):
                seq.state = RequestState.PREFILLING
                seq.emit(PrefillProgress(seq.id, seq.num_computed, seq.prompt_len, now))
                continue
            token = next(tokens)
            if token is None:
                self.finish(seq, FinishReason.ERROR, NON_FINITE_LOGITS)
                continue
            self._append_token(seq, token, now)
        for seq in list(self.running):
            if (
                seq.since_admission >= self.config.max_rq_tokens
                and seq.num_computed % self.config.page_size == 0
                and self.waiting
            ):
                self.requeue(seq)
        # timed before the type-ahead's bookkeeping, which the streams' own steps lack
        seconds = time.monotonic() - started
        type_ahead = plan.type_ahead
        if type_ahead is None:
            self.pacer.observe(plan.kind, seconds, sum(n for _, n in plan.runs))
            return StepTokens(now, decode_tokens, prefill_tokens)
        seq, n = type_ahead
        self._after_type_ahead_chunk(seq, n)
        if plan.requests:  # beside decodes: what the chunk cost the streams
            self.type_ahead_pacer.observe(seconds, self.pacer.decode_step_s, n)
        else:  # alone: a prefill step like a prompt's, for the same time bound
            self.pacer.observe(StepKind.PREFILL, seconds, n)
        return StepTokens(now, decode_tokens, prefill_tokens + n)

    def fail_step(self, plan: StepPlan, message: str) -> None:
        """The forward failed: this step's sequences fail (a type-ahead is dropped, releasing
        its reservation), the others go on."""
        for seq, _ in plan.runs:
            self.finish(seq, FinishReason.ERROR, message)

    def _after_type_ahead_chunk(self, seq: Sequence, n: int) -> None:
        """Record the chunk's K/V, give the pages back to the cache, report the progress."""
        start = seq.num_computed
        self.table.commit(seq.id, seq.tokens[start : start + n])
        self.table.release(seq.id)
        seq.num_computed = start + n
        if seq.to_compute <= 0:
            self.finish(seq, FinishReason.STOP)
        seq.report_progress()

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.tokens.append(token)
        seq.since_admission += 1
        self.generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.state = RequestState.DECODING
        reason = None
        if token in seq.stop_ids:
            reason = FinishReason.STOP
        elif (
            len(seq.generated_ids) >= seq.request.max_tokens or len(seq.tokens) >= self.max_context
        ):
            reason = FinishReason.LENGTH
        text, hit_stop = token_text(seq, token, final=reason is not None)
        if text:
            seq.text += text
        seq.emit(TokenGenerated(seq.id, text, (token,), now))
        if hit_stop:
            reason = FinishReason.STOP
        if reason is not None:
            self.finish(seq, reason)
