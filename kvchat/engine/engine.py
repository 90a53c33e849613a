"""The engine: one thread runs the step loop over the paged cache and the model.

A step is schedule, run, postprocess, whatever the sequences are: the scheduler picks
this step's runs (`scheduler`: requests, and a type-ahead's chunk at background
priority), the model runs them as one batch (`batch_builder`, the paged attention) and
a token is sampled for each run that reached its end (`sampling`); then the scheduler
moves every run on (text, events, states, finishes, the pacers). A step with nothing
to run does idle housekeeping instead (`idle_housekeeping`).

`submit`, `type_ahead`, `cancel`, `prefetch`, `residency` and `stats` are safe from any
thread and never wait for a forward pass: new sequences go through an inbox the step
thread drains, and `stats()` returns the snapshot published after the last step. The
page table is touched by the step thread only, except `residency()`, which reads
it under a lock that the step thread holds for bookkeeping but never across a
forward pass.

`Engine` stays one class on purpose: its thread-safe API and its step loop share
that lock and the inbox; what happens to a sequence once it is in lives in the
scheduler.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from kvchat.engine.attention.attention_choice import make_attention, resolve_attention
from kvchat.engine.batch_builder import build_batch
from kvchat.engine.config import EngineConfig
from kvchat.engine.events import EngineEvent, TypeAheadProgress
from kvchat.engine.heap_trim import HeapTrim
from kvchat.engine.idle_housekeeping import IdleHousekeeping
from kvchat.engine.kv_cache import build_kv_cache
from kvchat.engine.request import FinishReason, GenerationRequest
from kvchat.engine.sampling import sample_step
from kvchat.engine.scheduler import Scheduler, StepPlan
from kvchat.engine.sequence import Sequence
from kvchat.engine.sequence_states import SequenceStates, StepStates
from kvchat.engine.stats import DiskBytes, EngineStats, Residency, TierPages
from kvchat.engine.tiers.disk_tier import DiskTier
from kvchat.model.batch import ForwardBatch
from kvchat.model.detokenizer import IncrementalDetokenizer
from kvchat.native import build as native_build
from kvchat.rate_window import RateWindow

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0
DECODE_TOKENS, PREFILL_TOKENS = 0, 1  # the kinds `_rates` counts


@dataclass(frozen=True)
class _ScheduledStep:
    """What `_schedule` planned for one step: the runs, and their batch."""

    plan: StepPlan
    batch: ForwardBatch
    page_lists: list[tuple[int, ...]]
    window_page_lists: list[tuple[int, ...]] | None  # the windowed layers' slots, if apart


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
            sinks=mc.attention_sinks,
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
        self.window_store = cache.window_store  # the windowed layers', where they are apart
        self.disk: DiskTier | None = cache.disk
        self.table = cache.table
        ps = self.config.page_size
        self.attention = make_attention(
            self.store,
            self.attention_kind,
            max_batch=self.config.max_batch,
            window_store=self.window_store,
            groups=cache.groups,
        )
        if self.transformer.device.type == "cpu":
            native_build.request()  # in the background: torch's kernels serve until it loads
        self.scheduler = Scheduler(self.config, self.table, self.max_context)
        # a hybrid model's linear layers: each live sequence's state between its steps
        linear = len(mc.linear_layers)
        self.sequence_states = SequenceStates(linear, ps) if linear else None
        self._kept_states: StepStates | None = None  # the last forward's, for postprocess
        self.stop_ids = frozenset(self.tokenizer.stop_token_ids)

        self._lock = threading.Lock()  # guards the page table and the inbox
        self._wake = threading.Event()
        self._inbox: list[Sequence] = []
        self._replaced: list[int] = []  # type-aheads that newer ones replace
        self._cancels: set[int] = set()
        self._prefetches: list[tuple[int, ...]] = []
        self._next_id = 1
        self._stopping = False
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
        return -(-pages * self.kv_store_bytes // self.store.num_pages // 2**20)

    @property
    def kv_store_bytes(self) -> int:
        """Bytes of the device KV stores: the pages' and the windowed layers' slots."""
        window = self.window_store.nbytes() if self.window_store is not None else 0
        return self.store.nbytes() + window

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

    def type_ahead(
        self,
        token_ids: Seq[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """Compute `token_ids` ahead at background priority, while the user is still typing
        them (see `engine/scheduler.py`).

        Nothing is generated; `on_progress` hears how many tokens are computed.
        `replaces` cancels that type-ahead first (its computed pages stay cached);
        `cancel` ends this one the same way.
        """
        with self._lock:
            seq_id = self._next_id
            self._next_id += 1
            if replaces is not None:
                self._replaced.append(replaces)
            self._inbox.append(Sequence.for_type_ahead(seq_id, tuple(token_ids), on_progress))
        self._wake.set()
        return seq_id

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
            for seq in list(self.scheduler.live.values()):
                self.scheduler.finish(seq, FinishReason.CANCELLED)

    def step(self) -> bool:
        """Run one step: schedule, run the model, postprocess. False when there was nothing to do.

        A step with nothing to run does a slice of idle housekeeping instead, and counts
        as work while that is under way, so the loop looks at the inbox between slices.
        """
        scheduled = self._schedule()
        if scheduled is None:
            return self._idle_step()
        started = time.monotonic()
        sampled = self._run(scheduled)
        if sampled is not None:
            self._postprocess(scheduled, sampled, started)
        self._heap.after_step(scheduled.batch.num_tokens)
        return True

    def _schedule(self) -> _ScheduledStep | None:
        """Take in new requests and cancels, plan this step and build its batch (None: idle)."""
        with self._lock:
            self._drain_inbox()
            plan = self.scheduler.schedule()
            if plan.empty:
                return None
            self._idle.work_came()
            batch, page_lists, window_lists = build_batch(plan, self.table, self.transformer.device)
            return _ScheduledStep(plan, batch, page_lists, window_lists)

    def _run(self, step: _ScheduledStep) -> list[int | None] | None:
        """The forward pass, outside the lock, and the tokens it gives; on failure this
        step's sequences fail (None)."""
        self._kept_states = None
        try:
            if step.window_page_lists is None:
                self.attention.prepare(step.batch, step.page_lists)
            else:
                self.attention.prepare(step.batch, step.page_lists, step.window_page_lists)
            self.mover.wait_for_copies()  # pages restored from the host tier (CUDA)
            if self.sequence_states is None:
                logits = self.transformer.forward(step.batch, self.attention)
            else:  # a hybrid model: its linear layers continue each sequence's state
                runs = [(seq.id, seq.num_computed, n) for seq, n in step.plan.runs]
                states = self.sequence_states.for_step(runs, self.table.resume_state)
                logits = self.transformer.forward(step.batch, self.attention, states)
                self._kept_states = states
        except Exception as exc:  # fail this step's sequences, keep serving the others
            log.exception("forward pass failed")
            with self._lock:
                self.scheduler.fail_step(step.plan, f"The model failed on this request: {exc}")
            return None
        return sample_step(logits, step.plan.runs)

    def _postprocess(self, step: _ScheduledStep, sampled: list[int | None], started: float) -> None:
        """The scheduler moves every run on (tokens, events, pacers); then the stats."""
        with self._lock:
            if self._kept_states is not None:  # before a finished sequence's pages settle
                self._keep_states_at_page_ends(step, self._kept_states)
                self._kept_states = None
            done = self.scheduler.postprocess(step.plan, sampled, started)
            if self.sequence_states is not None:
                self.sequence_states.forget_ended(self.table.is_live)
            self._rates.add(done.ended, done.decode_tokens, done.prefill_tokens, started=started)
            self._publish_stats()

    def _keep_states_at_page_ends(self, step: _ScheduledStep, states: StepStates) -> None:
        """Hand the table the linear layers' states where this step ended pages."""
        S = self.config.page_size
        for (run, offset), layers in states.kept.items():
            seq, _ = step.plan.runs[run]
            end = seq.num_computed + offset  # a multiple of S: the page before it ends there
            self.table.keep_state(step.page_lists[run][end // S - 1], tuple(layers))

    def _idle_step(self) -> bool:
        """Fail a prompt that can never fit, else one slice of housekeeping; False when done."""
        with self._lock:
            stuck = self.scheduler.unfittable()
            if stuck is not None:
                self.scheduler.finish(stuck, FinishReason.ERROR, self._out_of_cache_message(stuck))
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
        if self.window_store is not None:  # the same share of the windowed layers' slots
            first, last = (i * self.window_store.num_pages // self.store.num_pages for i in touch)
            self.window_store.touch(first, last)
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

    def _drain_inbox(self) -> None:
        for seq in self._inbox:
            self.scheduler.add(seq, problem=self._validate(seq))
        self._inbox.clear()
        for seq_id in self._replaced:
            self.scheduler.cancel(seq_id, type_ahead_only=True)
        self._replaced.clear()
        for seq_id in self._cancels:
            self.scheduler.cancel(seq_id)
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

    def _fail_all(self, message: str) -> None:
        """Finish every live request with an error, so no caller waits forever after a bug."""
        with self._lock:
            self.scheduler.fail_all(message)

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
        self._stats = EngineStats(
            cache=counters,
            generated_tokens=self.scheduler.generated_tokens,
            pages=pages,
            disk_bytes=disk_bytes,
            disk_notice=notice,
            requests=self.scheduler.request_states(),
            preemptions=self.scheduler.preemptions,
            drafts=len(self.scheduler.type_aheads),
            decode_tok_s=decode_rate,
            prefill_tok_s=prefill_rate,
            page_size=self.config.page_size,
            time=now,
            window=t.window,
            window_let_go=self.table.window.let_go if self.table.window is not None else 0,
            states_kept=len(self.table.states) if self.table.states is not None else 0,
            state_bytes=self.table.states.nbytes() if self.table.states is not None else 0,
        )
