"""The engine: one thread runs the step loop over the paged cache and the model.

A step is schedule, run, postprocess: the scheduler picks this step's runs
(`scheduler`, and a draft chunk from `drafts`), the model runs them as one batch
(`batch_builder`, the paged attention), and each finished run's token is sampled,
turned into text (`detokenize`, `stop_strings`) and streamed. A step with nothing
to run does idle housekeeping instead (`idle_housekeeping`).

`submit`, `draft`, `cancel`, `prefetch`, `residency` and `stats` are safe from any thread
and never wait for a forward pass: requests go through an inbox the step thread
drains, and `stats()` returns the snapshot published after the last step. The
page table is touched by the step thread only, except `residency()`, which reads
it under a lock that the step thread holds for bookkeeping but never across a
forward pass.

`Engine` stays one class on purpose: its thread-safe API and its step loop share
that lock, the inbox and the live requests, and a request's whole life (validated,
admitted, computed, sampled, finished, counted in the stats) reads in one place.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from kvchat.engine.attention.attention_choice import make_attention, resolve_attention
from kvchat.engine.batch_builder import build_batch
from kvchat.engine.config import EngineConfig
from kvchat.engine.drafts import Draft, DraftQueue, DraftRun
from kvchat.engine.events import (
    DraftProgress,
    EngineEvent,
    PrefillProgress,
    RequestFinished,
    RequestStarted,
    TokenGenerated,
)
from kvchat.engine.heap_trim import HeapTrim
from kvchat.engine.idle_housekeeping import IdleHousekeeping
from kvchat.engine.kv_cache import build_kv_cache
from kvchat.engine.request import FinishReason, GenerationRequest, RequestState
from kvchat.engine.sampling import sample_next
from kvchat.engine.scheduler import Scheduler, StepPlan
from kvchat.engine.sequence import Sequence
from kvchat.engine.stats import DiskBytes, EngineStats, Residency, TierPages
from kvchat.engine.step_pacer import StepKind
from kvchat.engine.text_stream import token_text
from kvchat.engine.tiers.disk_tier import DiskTier
from kvchat.model.batch import ForwardBatch
from kvchat.model.detokenizer import IncrementalDetokenizer
from kvchat.native import build as native_build
from kvchat.rate_window import RateWindow

log = logging.getLogger(__name__)

NON_FINITE_LOGITS = (
    "The model produced NaN or infinite logits, so no token can be chosen. The model file "
    "may be corrupt, or its weights overflow this dtype: try --dtype float32, or re-download "
    "the model."
)
RATE_WINDOW_S = 5.0
DECODE_TOKENS, PREFILL_TOKENS = 0, 1  # the kinds `_rates` counts


@dataclass(frozen=True)
class _ScheduledStep:
    """What `_schedule` planned for one step: the runs, a draft chunk, and their batch."""

    plan: StepPlan
    draft: DraftRun | None
    batch: ForwardBatch
    page_lists: list[tuple[int, ...]]


def freeze_long_lived_objects() -> None:
    """Take every object alive now out of the garbage collector's walks (`gc.freeze`).

    Why: once the model is loaded, tens of thousands of Python objects (modules,
    parameters, the tokenizer's tables, the page table) live as long as the engine, and
    every full collection walks all of them. The engine makes short-lived objects every
    step, so collections come every few seconds and land inside steps. Objects frozen
    here are still freed by reference counting when dropped (measured:
    docs/architecture.md).
    """
    gc.freeze()


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, *, start: bool = True):
        """`model` is a `kvchat.model.loader.LoadedModel` (transformer, tokenizer, fingerprint)."""
        self.config = config or EngineConfig()
        self.model = model
        self.transformer = model.transformer
        self.tokenizer = model.tokenizer
        mc = model.config
        self.attention_kind = resolve_attention(
            self.config.attention,
            self.transformer.device,
            self.config.kv_format,
            windowed=mc.layer_windows is not None or mc.attention_sinks,
        )
        self.max_context = min(
            mc.max_position_embeddings,
            self.transformer.max_positions,
            self.config.context_tokens or mc.max_position_embeddings,
            mc.sliding_window or mc.max_position_embeddings,  # see `ModelConfig.sliding_window`
        )
        cache = build_kv_cache(
            model,
            self.config,
            self.max_context,
            busy=lambda: bool(self.scheduler.running or self.scheduler.waiting),
        )
        self.store, self.host_store, self.mover = cache.store, cache.host_store, cache.mover
        self.disk: DiskTier | None = cache.disk
        self.table = cache.table
        ps = self.config.page_size
        self.attention = make_attention(
            self.store, self.attention_kind, max_batch=self.config.max_batch
        )
        if self.transformer.device.type == "cpu":
            native_build.request()  # in the background: torch's kernels serve until it loads
        self.scheduler = Scheduler(self.config, self.table)
        self.drafts = DraftQueue(self.config.step_token_budget)
        self.stop_ids = frozenset(self.tokenizer.stop_token_ids)

        self._lock = threading.Lock()  # guards the page table and the inbox
        self._wake = threading.Event()
        self._inbox: list[Sequence] = []
        self._draft_inbox: list[tuple[Draft, int | None]] = []  # (draft, the one it replaces)
        self._cancels: set[int] = set()
        self._prefetches: list[tuple[int, ...]] = []
        self._next_id = 1
        self._seqs: dict[int, Sequence] = {}
        self._stopping = False
        self._generated = 0
        self._rates = RateWindow(RATE_WINDOW_S, kinds=2)  # decode tokens, prefill tokens
        self._idle = IdleHousekeeping(self.store)
        self._heap = HeapTrim()
        self._stats = EngineStats(page_size=ps)
        self._publish_stats()
        self._thread = threading.Thread(target=self._loop, name="kvchat-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def launch(cls, load: Callable[[], object], config: EngineConfig | None = None) -> Engine:
        """Load the model on the engine's own thread, then run the step loop on it.

        Why: torch's OpenMP pool belongs to the thread that first runs parallel work, and
        a second live thread running torch ops is much slower than the first (measured:
        docs/architecture.md). So one thread does all of kvchat's torch work: loading,
        then every step.
        """
        ready = threading.Event()
        box: dict[str, object] = {}

        def run() -> None:
            try:
                engine = cls(load(), config, start=False)
            except BaseException as exc:  # handed to the caller, raised there
                box["error"] = exc
                ready.set()
                return
            engine._thread = threading.current_thread()
            freeze_long_lived_objects()
            box["engine"] = engine
            ready.set()
            engine._loop()

        thread = threading.Thread(target=run, name="kvchat-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["engine"]  # type: ignore[return-value]

    def run_until_idle(self) -> None:
        """Step on the calling thread until nothing is queued or running.

        For an engine made with `start=False` whose caller owns the torch thread (the
        bench steps kvchat on the thread that also runs the peers, see `launch`).
        """
        while self.step():
            pass

    # ---- the thread-safe API ---------------------------------------------------------------

    @property
    def model_fingerprint(self) -> str:
        return self.model.fingerprint

    @property
    def context_length(self) -> int:
        return self.max_context

    @property
    def device_cache_tokens(self) -> int:
        """Tokens the device cache holds: the longest sequence that can ever run."""
        return self.store.num_pages * self.config.page_size

    def device_cache_mib_for(self, tokens: int) -> int:
        """The smallest --device-cache, in MiB, whose pages hold `tokens` tokens."""
        pages = -(-tokens // self.config.page_size)
        return -(-pages * self.store.page_bytes() // 2**20)

    def submit(self, request: GenerationRequest, on_event: Callable[[EngineEvent], None]) -> int:
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            seq = Sequence(
                request_id, request, on_event, IncrementalDetokenizer(self.tokenizer), self.stop_ids
            )
            self._inbox.append(seq)
        self._wake.set()
        return request_id

    def draft(
        self,
        token_ids: Seq[int],
        on_progress: Callable[[DraftProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """Compute `token_ids` ahead at the lowest priority (see `engine/drafts.py`).

        Nothing is generated; `on_progress` hears how many tokens are computed.
        `replaces` cancels that draft first (its computed pages stay cached);
        `cancel` ends this one the same way.
        """
        with self._lock:
            draft_id = self._next_id
            self._next_id += 1
            self._draft_inbox.append((Draft(draft_id, tuple(token_ids), on_progress), replaces))
        self._wake.set()
        return draft_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancels.add(request_id)
        self._wake.set()

    def prefetch(self, token_ids: Seq[int]) -> None:
        with self._lock:
            self._prefetches.append(tuple(token_ids))
        self._wake.set()

    def residency(self, token_ids: Seq[int]) -> Residency:
        with self._lock:
            return self.table.residency(token_ids)

    def stats(self) -> EngineStats:
        return self._stats

    def validate_cache(self) -> None:
        """Check the page table's invariants while the engine thread cannot touch it.

        A live engine defragments and evicts on its own thread when idle, so a check from
        another thread without the lock can catch a move half made; this one takes the lock.
        """
        with self._lock:
            self.table.validate()

    def close(self) -> None:
        """Stop the step loop, then let the disk tier finish its pending writes (bounded)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the step loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                worked = self.step()
            except Exception as exc:  # a bug: log it, fail what was live, keep serving
                log.exception("engine step failed")
                self._fail_all(f"The engine hit an internal error ({exc}); see the error log.")
                worked = True
            if not worked:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
        with self._lock:
            for seq in list(self._seqs.values()):
                self._finish(seq, FinishReason.CANCELLED)

    def step(self) -> bool:
        """Run one step: schedule, run the model, postprocess. False when there was nothing to do.

        A step with nothing to run does a slice of idle housekeeping instead, and counts
        as work while that is under way, so the loop looks at the inbox between slices.
        """
        scheduled = self._schedule()
        if scheduled is None:
            return self._idle_step()
        started = time.monotonic()
        logits = self._run(scheduled)
        if logits is not None:
            self._postprocess(scheduled, logits, started)
        self._heap.after_step(scheduled.batch.num_tokens)
        return True

    def _schedule(self) -> _ScheduledStep | None:
        """Take in new requests and cancels, plan this step and build its batch (None: idle)."""
        with self._lock:
            self._drain_inbox()
            plan = self.scheduler.schedule()
            draft = self._plan_draft(plan)
            if plan.empty and draft is None:
                return None
            self._idle.work_came()
            for seq, reservation in plan.admitted:
                self._on_admitted(seq, reservation)
            for seq in plan.preempted:
                seq.state = RequestState.PREEMPTED
            batch, page_lists = build_batch(plan, draft, self.table, self.transformer.device)
            return _ScheduledStep(plan, draft, batch, page_lists)

    def _run(self, step: _ScheduledStep) -> torch.Tensor | None:
        """The forward pass, outside the lock; on failure this step's requests fail (None)."""
        try:
            self.attention.prepare(step.batch, step.page_lists)
            self.mover.wait_for_copies()  # pages restored from the host tier (CUDA)
            return self.transformer.forward(step.batch, self.attention)
        except Exception as exc:  # fail this step's requests, keep serving the others
            log.exception("forward pass failed")
            with self._lock:
                for seq, _ in step.plan.runs:
                    self._fail(seq, f"The model failed on this request: {exc}")
                if step.draft is not None:
                    self.drafts.abort_step(step.draft, self.table)
            return None

    def _postprocess(self, step: _ScheduledStep, logits: torch.Tensor, started: float) -> None:
        """Commit the step's K/V, sample and stream tokens, feed the pacers, publish stats."""
        plan, draft = step.plan, step.draft
        with self._lock:
            self._after_forward(plan, logits, started)
            seconds = time.monotonic() - started
            tokens = sum(n for _, n in plan.runs)
            if draft is None:
                self.scheduler.pacer.observe(plan.kind, seconds, tokens)
            else:
                self.drafts.finish_step(draft, self.table)
                self._rates.add_to_last(PREFILL_TOKENS, draft.n)
                if plan.runs:  # beside decodes: what the draft chunk cost the streams
                    decode_s = self.scheduler.pacer.decode_step_s
                    self.drafts.pacer.observe(seconds, decode_s, draft.n)
                else:  # alone: a prefill step like a prompt's, for the same time bound
                    self.scheduler.pacer.observe(StepKind.PREFILL, seconds, draft.n)
            self._publish_stats()

    def _idle_step(self) -> bool:
        """Fail a prompt that can never fit, else one slice of housekeeping; False when done."""
        with self._lock:
            stuck = self.scheduler.unfittable()
            if stuck is not None:
                self._fail(stuck, self._out_of_cache_message(stuck))
                return True
            if self._idle.defragment_slice(self.table, running=bool(self.scheduler.running)):
                self._publish_stats()  # more may be left: come back after a look at the inbox
                return True
            self._publish_stats()
            touch = self._idle.next_touch(self.store)
        self._heap.at_idle()  # outside the lock, like the touching below
        if touch is None:
            return False
        self.store.touch(*touch)  # outside the lock: submit() never waits for page faults
        return True

    def _out_of_cache_message(self, seq: Sequence) -> str:
        """Why a request that can never fit failed: its prompt, or the reply that grew until
        prompt and reply together filled the whole device cache."""
        capacity = self.device_cache_tokens
        generated = len(seq.tokens) - seq.prompt_len
        if generated > 0:
            return (
                f"The reply reached the device cache's capacity: its {seq.prompt_len:,} prompt "
                f"tokens and {generated:,} generated tokens fill all {capacity:,} tokens the "
                "device cache holds, so it stopped here (the text so far is kept). To go on, "
                "raise --device-cache, or lower the reply's max tokens."
            )
        return self._prompt_too_big_message(seq.prompt_len)

    def _prompt_too_big_message(self, prompt_len: int) -> str:
        """A prompt larger than the whole device cache: the size that would hold it."""
        needed_mib = self.device_cache_mib_for(prompt_len + 1)  # room for the first token
        return (
            f"The prompt ({prompt_len:,} tokens) does not fit in the device cache "
            f"({self.device_cache_tokens:,} tokens) even when it is empty; start kvchat with "
            f"--device-cache {needed_mib}MiB or more, or shorten the conversation (edit the "
            "last message, or fork at an earlier one)."
        )

    def _plan_draft(self, plan: StepPlan) -> DraftRun | None:
        """A draft chunk for this step, if drafts may run beside what the plan holds."""
        running = self.scheduler.running
        return self.drafts.plan(
            self.table,
            prompts_pending=bool(self.scheduler.waiting) or plan.decodes < len(plan.runs),
            decodes=plan.decodes,
            slots_free=self.config.max_batch - len(running),
            decode_step_s=self.scheduler.pacer.decode_step_s,
            idle_budget=self.scheduler.pacer.prefill_tokens(self.config.step_token_budget),
        )

    def _drain_inbox(self) -> None:
        for seq in self._inbox:
            self._seqs[seq.id] = seq
            seq.emit(RequestStarted(seq.id, time.monotonic()))
            problem = self._validate(seq)
            if problem:
                self._fail(seq, problem)
            else:
                self.scheduler.add(seq)
        self._inbox.clear()
        for draft, replaces in self._draft_inbox:
            if replaces is not None:
                self.drafts.cancel(replaces)
            problem = self._validate_tokens(draft.tokens)
            if problem:  # a draft is only a guess: the turn will report the problem
                log.info("draft %d dropped: %s", draft.id, problem)
            else:
                self.drafts.add(draft)
        self._draft_inbox.clear()
        for request_id in self._cancels:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._finish(seq, FinishReason.CANCELLED)
            else:
                self.drafts.cancel(request_id)
        self._cancels.clear()
        for tokens in self._prefetches:
            self.table.prefetch(tokens)
        self._prefetches.clear()

    def _validate(self, seq: Sequence) -> str | None:
        return self._validate_tokens(seq.tokens)

    def _validate_tokens(self, tokens: Seq[int]) -> str | None:
        n = len(tokens)
        if n == 0:
            return "The prompt is empty."
        if n >= self.max_context:
            return (
                f"The prompt has {n} tokens but the model's context holds {self.max_context}; "
                "shorten the conversation or start a new session."
            )
        vocab = self.model.config.vocab_size
        if max(tokens) >= vocab or min(tokens) < 0:
            return "The prompt has token ids outside the model's vocabulary (another model's ids?)."
        if n // self.config.page_size + 1 > self.table.num_pages:
            return self._prompt_too_big_message(n)
        return None

    def _on_admitted(self, seq: Sequence, reservation) -> None:
        if not seq.admitted:
            seq.admitted = True
            seq.cached = reservation.cached
            seq.prefilled_tokens = len(seq.tokens) - reservation.cached_tokens
            seq.draft_tokens = reservation.cached_draft
        else:
            seq.recomputed_tokens += len(seq.tokens) - reservation.cached_tokens
        seq.state = (
            RequestState.PREFILLING
            if seq.to_compute > 1 or not seq.generated_ids
            else RequestState.DECODING
        )

    def _after_forward(self, plan: StepPlan, logits: torch.Tensor, started: float) -> None:
        now = time.monotonic()
        logits = logits.cpu()
        all_finite = bool(torch.isfinite(logits).all())  # one check a step; per row only if not
        row = 0
        decode_tokens = prefill_tokens = 0
        for seq, n in plan.runs:
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
            if not all_finite and not bool(torch.isfinite(logits[row]).all()):
                row += 1
                self._fail(seq, NON_FINITE_LOGITS)
                continue
            token = sample_next(logits[row], seq.request.sampling, seq.generator, seq.tokens)
            row += 1
            self._append_token(seq, token, now)
        self._rates.add(now, decode_tokens, prefill_tokens, started=started)
        for seq in list(self.scheduler.running):
            if (
                seq.since_admission >= self.config.max_rq_tokens
                and seq.num_computed % self.config.page_size == 0
                and self.scheduler.waiting
            ):
                self.scheduler.requeue(seq)

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.tokens.append(token)
        seq.since_admission += 1
        self._generated += 1
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
            self._finish(seq, reason)

    def _fail_all(self, message: str) -> None:
        """Finish every live request with an error, so no caller waits forever after a bug."""
        with self._lock:
            try:
                self.drafts.release_all(self.table)
            except Exception:
                log.exception("releasing drafts after an engine error")
            for seq in list(self._seqs.values()):
                try:
                    self._fail(seq, message)
                except Exception:  # the table itself may be what broke: still tell the caller
                    log.exception("failing a request after an engine error")
                    self._seqs.pop(seq.id, None)

    def _fail(self, seq: Sequence, message: str) -> None:
        self._finish(seq, FinishReason.ERROR, message)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.state == RequestState.FINISHED:
            return
        self.scheduler.remove(seq)
        self._seqs.pop(seq.id, None)
        seq.state = RequestState.FINISHED
        now = time.monotonic()
        generated = seq.generated_ids
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.submit_time
        decode_rate = None
        if seq.first_token_time is not None and len(generated) > 1 and now > seq.first_token_time:
            decode_rate = (len(generated) - 1) / (now - seq.first_token_time)
        if reason == FinishReason.CANCELLED or reason == FinishReason.ERROR:
            seq.text += seq.pending_text
            seq.pending_text = ""
        seq.emit(
            RequestFinished(
                request_id=seq.id,
                reason=reason,
                prompt_tokens=seq.prompt_len if seq.admitted else 0,
                cached_tokens=seq.cached,
                prefilled_tokens=seq.prefilled_tokens,
                recomputed_tokens=seq.recomputed_tokens,
                generated_ids=tuple(generated),
                text=seq.text,
                ttft_s=ttft,
                decode_tok_s=decode_rate,
                time=now,
                error=error,
                draft_tokens=seq.draft_tokens,
            )
        )

    def _publish_stats(self) -> None:
        now = time.monotonic()
        decode_rate = self._rates.rate(now, DECODE_TOKENS) or 0.0
        prefill_rate = self._rates.rate(now, PREFILL_TOKENS) or 0.0
        t = self.table.stats()
        pages, counters = t.pages, t.counters  # the disk tier off: its pages stay empty
        disk_bytes, notice = DiskBytes(), None
        if self.disk is not None:
            d = self.disk.stats()
            free = max(0, d.capacity_pages - d.pages)
            pages = replace(pages, disk=TierPages(d.capacity_pages, 0, d.pages, free))
            counters = counters.evicted(disk_dropped=d.dropped)
            disk_bytes, notice = DiskBytes(d.capacity_bytes, d.used_bytes), d.notice
        states: dict[str, int] = {s.value: 0 for s in RequestState if s != RequestState.FINISHED}
        for seq in self._seqs.values():
            if seq.state != RequestState.FINISHED:
                states[seq.state.value] += 1
        self._stats = EngineStats(
            cache=counters,
            generated_tokens=self._generated,
            pages=pages,
            disk_bytes=disk_bytes,
            disk_notice=notice,
            requests=states,
            preemptions=self.scheduler.preemptions,
            drafts=len(self.drafts),
            decode_tok_s=decode_rate,
            prefill_tok_s=prefill_rate,
            page_size=self.config.page_size,
            time=now,
        )
