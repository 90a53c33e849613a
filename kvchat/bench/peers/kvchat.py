"""kvchat itself, driven exactly as its users drive it.

Chat turns go through the session layer (`SessionService`: stored ids plus the
new turn, never a re-render), so W1 measures what the TUI and `kvchat run` get.
Batched generation (W2) and the interference run (W3) submit to the `Engine`
directly, whose token events carry their own timestamps. The prefill speed is
one forward pass of the transformer over a fresh paged cache (logits of the
last token only); the batch-1 decode rate is the engine's own, step loop
included.

The engine is stepped on the bench's own thread (`start=False`, `_drive`), the
thread that also runs the peers: torch's OpenMP pool belongs to the first thread
that runs parallel work, and a second live thread running torch ops is 30-50%
slower on the 2-core target (see `Engine.launch`). The product gets the same
single-thread arrangement from `Engine.launch`, which loads and steps on one thread.
"""

from __future__ import annotations

import math
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvchat.bench.peers.base import BatchResult, SpeedMeasured, TurnResult
from kvchat.chat.events import ReplyDelta, ReplyFinished, SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.attention.attention_choice import make_attention, resolve_attention
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine, freeze_long_lived_objects
from kvchat.engine.events import EngineEvent, RequestFinished, TokenGenerated
from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.engine.stats import EngineStats
from kvchat.engine.tiers.kv_store import DeviceKVStore, kv_bytes_per_token
from kvchat.errors import KvchatError
from kvchat.model.batch import ForwardBatch
from kvchat.model.device import dtype_name
from kvchat.native import build as native_build

GREEDY = SamplingParams(temperature=0.0)
DISK_BENCH_BYTES = 64 << 30  # a bench run's disk tier never evicts: it measures reads
TURN_TIMEOUT_S = 1800.0


def _drive(engine: Engine, done, timeout: float = TURN_TIMEOUT_S) -> None:
    """Step `engine` on this thread until `done()`; the engine's own thread never starts."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise KvchatError("a bench request did not finish in time")
        if not engine.step():
            time.sleep(0.0005)  # idle: events are in flight through the session layer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_engine(model, config: EngineConfig) -> Engine:
    """A new engine (nothing cached) after its idle work, as the app's engine does it
    between launch and the first message: faulting in its KV store (see
    `DeviceKVStore.touch`). A few hundred MB of store take ~1 s, outside every timing."""
    engine = Engine(model, config, start=False)
    engine.run_until_idle()
    freeze_long_lived_objects()  # as `Engine.launch` does once the app's engine is up
    return engine


class KvchatChat:
    """Sessions through `SessionService` over a fresh engine (nothing cached in memory).

    With `store_path`, sessions live in that database, so a second `KvchatChat` on the
    same path (and disk-tier folder) is kvchat after a restart (W5).
    """

    def __init__(self, model, config: EngineConfig, store_path: Path | None = None) -> None:
        self.engine = fresh_engine(model, config)
        self.service = SessionService(
            self.engine,
            model.renderer,
            Store(store_path) if store_path is not None else Store.in_memory(),
            stop_token_ids=model.tokenizer.stop_token_ids,
            default_sampling=GREEDY,
        )
        self._events: queue.Queue = queue.Queue()
        self.service.subscribe(self._events.put)
        self.sessions: list[str] = []

    def new_session(self) -> str:
        session_id = self.service.create_session("bench")
        self.sessions.append(session_id)
        return session_id

    def type_ahead(self, session: object, text: str) -> None:
        """The user's unsent message, computed ahead (type-ahead) while `pause` steps."""
        self.service.type_ahead(str(session), text)

    def pause(self, seconds: float) -> None:
        """Let `seconds` pass as a person typing would, stepping the engine meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.engine.step():
                time.sleep(0.0005)

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        sid = str(session)
        before = len(self.service.token_ids(sid))  # previous prompt + its reply
        start = time.perf_counter()
        self.service.say(sid, text, sampling=GREEDY, max_tokens=max_tokens, ignore_eos=True)
        # the turn is in the engine's hands (say() sizes and starts it itself when the
        # planner is idle); the session layer's events and writes go on meanwhile, as they
        # do beside the app's engine thread
        self.service.wait_started()
        said = time.perf_counter()
        first: float | None = None
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while True:
            worked = self.engine.step()
            try:
                event = self._events.get(timeout=0 if worked else 0.0005)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise KvchatError("a bench turn did not finish in time") from None
                continue
            if isinstance(event, ReplyDelta) and event.session_id == sid and first is None:
                first = time.perf_counter()
            elif isinstance(event, SessionFailed) and event.session_id == sid:
                raise KvchatError(f"kvchat could not start a bench turn: {event.message}")
            elif isinstance(event, ReplyFinished) and event.session_id == sid:
                break
        end = time.perf_counter()
        stats = event.stats
        if stats.error is not None or first is None:
            raise KvchatError(f"kvchat failed a bench turn: {stats.error or 'no token came'}")
        # TTFT: say() until the engine emitted the first token (the engine measures from the
        # submit, once the turn is sized). Polling the session layer's
        # events between inline steps would add up to a few decode steps that a user, whose
        # engine runs on its own thread, never waits (the events reach the UI within a
        # millisecond there).
        ttft = (said - start) + stats.ttft_s if stats.ttft_s is not None else first - start
        return TurnResult(
            ttft_s=ttft,
            total_s=end - start,
            prompt_tokens=stats.prompt_tokens,
            prefilled_tokens=stats.prefilled_tokens,
            new_tokens=stats.prompt_tokens - before,
            generated_tokens=stats.generated_tokens,
            engine_ttft_s=stats.ttft_s,
            draft_tokens=stats.draft_tokens,
            text=event.text,
            cached_disk_tokens=stats.cached_tokens.disk,
        )

    def working_set_tokens(self) -> list[int]:
        """Each session's stored ids (history) length: what the cache must hold to hit."""
        return [len(self.service.token_ids(s)) for s in self.sessions]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        self.service.close()
        self.engine.close()


@dataclass
class _Stream:
    """Token times of one request (engine thread appends, bench thread reads after)."""

    times: list[float] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, TokenGenerated):
            self.times.append(event.time)
        elif isinstance(event, RequestFinished):
            self.error = event.error
            self.finished.set()

    def wait(self, engine: Engine) -> None:
        _drive(engine, self.finished.is_set)
        if self.error:
            raise KvchatError(f"kvchat failed a bench request: {self.error}")


def start_streams(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int
) -> tuple[list[_Stream], list[int]]:
    """One greedy stream of `max_tokens` tokens (end-of-sequence ignored) per prompt."""
    streams = [_Stream() for _ in prompts]
    ids = [
        engine.submit(GenerationRequest(tuple(p), GREEDY, max_tokens, ignore_eos=True), s)
        for p, s in zip(prompts, streams, strict=True)
    ]
    return streams, ids


def each_has(streams: Sequence[_Stream], counts: Sequence[int]) -> Callable[[], bool]:
    """True once each stream has its count of tokens (or has finished)."""
    return lambda: all(
        s.finished.is_set() or len(s.times) >= c for s, c in zip(streams, counts, strict=True)
    )


def stop_streams(engine: Engine, streams: Sequence[_Stream], ids: Sequence[int]) -> None:
    """Cancel the streams and step the engine until each has finished."""
    for request_id in ids:
        engine.cancel(request_id)
    for s in streams:
        _drive(engine, s.finished.is_set)


def split_gaps(
    streams: Sequence[_Stream], start: float, end: float
) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps outside and inside (start, end); the first gap skipped
    (it shares its step with the streams' prefill)."""
    alone: list[float] = []
    during: list[float] = []
    for s in streams:
        for a, b in zip(s.times[1:], s.times[2:], strict=False):
            (during if b > start and a < end else alone).append(b - a)
    return alone, during


class KvchatPeer(SpeedMeasured):
    def __init__(
        self,
        model,
        *,
        page_size: int,
        device_cache_bytes: int | None = None,
        host_cache_bytes: int | None = None,
        kv_format: str = "native",
        attention: str | None = None,
        name: str = "kvchat",
        weights: str = "native",
        disk_scratch: Path | None = None,
    ) -> None:
        """`disk_scratch`: a folder for disk tiers; each engine then gets a fresh one in it."""
        self.name = name
        self.attention = resolve_attention(
            attention, model.transformer.device, kv_format, sinks=model.config.attention_sinks
        )
        self.disk_scratch = disk_scratch
        self._disk_dir: Path | None = None
        self.model = model
        self.page_size = page_size
        self.kv_format = kv_format
        self.device_cache_bytes = device_cache_bytes  # the user's override, else sized per run
        self.host_cache_bytes = host_cache_bytes
        c = model.config
        self.bytes_per_token = kv_bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, model.transformer.dtype, kv_format
        )
        if model.transformer.device.type == "cpu":
            native_build.request(wait=True)  # measured with the kernels users get
        attention = {
            "native": "kvchat's attention kernel"
            if native_build.status().loaded
            else "torch SDPA attention",
            "flex": "torch FlexAttention (compiled)",
            "sdpa": "torch SDPA attention",
        }[self.attention]
        self.description = (
            f"kvchat {dtype_name(model.transformer.dtype)}, {weights} weights, paged "
            f"prefix-hashed KV cache ({page_size}-token pages, {kv_format} KV), {attention}, "
            "sessions through the session layer"
            + (", disk tier on" if disk_scratch is not None else "")
        )

    # ---- sizing ------------------------------------------------------------------------

    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

    def config(
        self,
        capacity_tokens: int,
        *,
        device_bytes: int | None = None,
        host_bytes: int | None = None,
        disk_dir: Path | None = None,
    ) -> EngineConfig:
        """An engine sized for `capacity_tokens` (plus slack), unless told otherwise.

        The disk tier is on with `disk_dir` (that folder, kept as it is), or for a peer
        made with `disk_scratch` (a fresh, empty folder for each engine); its capacity
        then holds everything the run writes, so it measures reads, not evictions.
        """
        pages = math.ceil(capacity_tokens / self.page_size) + 4
        dev = device_bytes or self.device_cache_bytes or pages * self.page_bytes()
        host = host_bytes
        if host is None:
            host = self.host_cache_bytes if self.host_cache_bytes is not None else dev
        if disk_dir is None and self.disk_scratch is not None:
            self._drop_disk_dir()  # the previous engine of this peer is closed by now
            self.disk_scratch.mkdir(parents=True, exist_ok=True)
            self._disk_dir = Path(tempfile.mkdtemp(prefix="kv-", dir=self.disk_scratch))
            disk_dir = self._disk_dir
        return EngineConfig(
            page_size=self.page_size,
            device_cache_bytes=dev,
            host_cache_bytes=host,
            kv_format=self.kv_format,
            attention=self.attention,
            disk_cache_bytes=0 if disk_dir is None else DISK_BENCH_BYTES,
            disk_cache_dir=disk_dir,
        )

    def _drop_disk_dir(self) -> None:
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    # ---- workloads -----------------------------------------------------------------------

    def warm_up(self, opener: str, follow_up: str, capacity_tokens: int) -> None:
        """One throwaway conversation, so no workload pays the process's first-use costs.

        The first forward passes of a process meet cold allocators and kernels picked
        per shape: measured as the first workload, a 1,024-token turn took 2.3 s
        instead of 0.3 s and its follow-up 0.87 s instead of 0.04 s.
        """
        chat = self.chat(capacity_tokens)
        try:
            session = chat.new_session()
            chat.turn(session, opener, 8)
            chat.turn(session, follow_up, 8)
        finally:
            chat.close()

    def chat(
        self,
        capacity_tokens: int,
        *,
        device_bytes: int | None = None,
        host_bytes: int | None = None,
        disk_dir: Path | None = None,
        store_path: Path | None = None,
    ) -> KvchatChat:
        cfg = self.config(
            capacity_tokens, device_bytes=device_bytes, host_bytes=host_bytes, disk_dir=disk_dir
        )
        return KvchatChat(self.model, cfg, store_path)

    def _decode_span(self, ids: Sequence[int], tokens: int) -> tuple[float, float, int]:
        """One greedy generation on a fresh engine (after a short warm-up request)."""
        config = self.config(len(ids) + tokens + 64)
        with fresh_engine(self.model, config) as engine:
            warm = _Stream()
            warm_up = GenerationRequest(tuple(ids[:32]), GREEDY, 4, ignore_eos=True)
            engine.submit(warm_up, warm)
            warm.wait(engine)
            stream = _Stream()
            request = GenerationRequest(tuple(ids), GREEDY, tokens, ignore_eos=True)
            engine.submit(request, stream)
            stream.wait(engine)
        t = stream.times
        return (t[0], t[-1], len(t)) if t else (0.0, 0.0, 0)

    def _prefill_seconds(self, ids: Sequence[int]) -> float:
        """One forward over `ids` into a fresh paged cache, logits of the last token only."""
        ids = list(ids)
        t = self.model.transformer
        c = self.model.config
        ps = self.page_size
        pages = math.ceil(len(ids) / ps)
        store = DeviceKVStore(
            c.num_layers, pages, ps, c.num_kv_heads, c.head_dim, t.dtype, t.device, self.kv_format
        )  # K, V: [L, P, S, Hkv, D]
        attention = make_attention(store, self.attention)
        batch = ForwardBatch.from_runs([ids], [0], device=t.device)
        attention.prepare(batch, [list(range(pages))])
        sync(t.device)
        start = time.perf_counter()
        t.forward(batch, attention)
        sync(t.device)
        return time.perf_counter() - start

    def batch(self, prompts: Sequence[Sequence[int]], tokens_each: int) -> BatchResult:
        capacity = sum(len(p) + tokens_each + self.page_size for p in prompts)
        with fresh_engine(self.model, self.config(capacity)) as engine:
            streams = [_Stream() for _ in prompts]
            start = time.monotonic()
            for prompt, stream in zip(prompts, streams, strict=True):
                request = GenerationRequest(tuple(prompt), GREEDY, tokens_each, ignore_eos=True)
                engine.submit(request, stream)
            for stream in streams:
                stream.wait(engine)
        all_first = max(s.times[0] for s in streams)
        end = max(s.times[-1] for s in streams)
        after = sum(1 for s in streams for t in s.times if t > all_first)
        rate = after / (end - all_first) if end > all_first else 0.0
        return BatchResult(len(prompts), tokens_each, rate, end - start)

    def interference(
        self,
        stream_prompts: Sequence[Sequence[int]],
        ingest_prompt: Sequence[int],
        baseline_tokens: int,
    ) -> dict[str, float | int]:
        """W3: the streams' inter-token latencies alone and while a long prompt is ingested.

        The same three streams run throughout: `baseline_tokens` each alone, then the
        ingest, then `baseline_tokens` more each alone. So the two percentiles come from
        the same requests, from samples of similar size (a p99 of a second of gaps is
        the one spike that second happened to hold, against one of twenty seconds), and
        from windows on both sides of the ingest, so the machine's drift hits both.
        """
        longest = max(len(p) for p in stream_prompts)
        # long enough to outlast the ingest (the streams are cancelled once it is done)
        max_stream = min(2048, self.model.context_length - longest - 8)
        max_stream = max(2 * baseline_tokens + 8, max_stream)
        capacity = len(ingest_prompt) + len(stream_prompts) * (longest + max_stream + 256)
        with fresh_engine(self.model, self.config(capacity)) as engine:
            streams, ids = start_streams(engine, stream_prompts, max_stream)
            # alone, before (the first gap is skipped: the streams' prefill shares its step)
            _drive(engine, each_has(streams, [baseline_tokens + 2] * len(streams)))
            ingest = _Stream()
            t_submit = time.monotonic()
            engine.submit(
                GenerationRequest(tuple(ingest_prompt), GREEDY, 1, ignore_eos=True), ingest
            )
            ingest.wait(engine)
            t_done = ingest.times[-1]
            # alone, after
            _drive(engine, each_has(streams, [len(s.times) + baseline_tokens + 1 for s in streams]))
            stop_streams(engine, streams, ids)
        alone, during = split_gaps(streams, t_submit, t_done)
        return {
            "itl_p50_alone_s": percentile(alone, 50),
            "itl_p99_alone_s": percentile(alone, 99),
            "itl_p50_ingest_s": percentile(during, 50),
            "itl_p99_ingest_s": percentile(during, 99),
            "itl_max_ingest_s": max(during, default=0.0),
            "ingest_tokens": len(ingest_prompt),
            "ingest_s": t_done - t_submit,
            "gaps_alone": len(alone),
            "gaps_during_ingest": len(during),
        }

    def close(self) -> None:
        self._drop_disk_dir()


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values): p99 of 50 gaps is the largest, not a blend."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
