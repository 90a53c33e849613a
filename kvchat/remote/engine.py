"""`RemoteEngine`: the session layer's `TurnPort` over an OpenAI-compatible server.

Each turn is one streamed `/v1/chat/completions` request on its own thread
(the server batches concurrent sessions), carrying the session's stable id in a
header so a router keeps a conversation on the replica holding its KV. Text
deltas become `TokenGenerated` events without ids; the final usage chunk
(`stream_options.include_usage`) gives the turn's figures: the server's cached
prompt tokens (`usage.prompt_tokens_details.cached_tokens`, or llama-server's
`timings.cache_n`), None when the server does not report them. TTFT and tok/s
are measured here. Failures before the first delta are retried with backoff
(the `openai` client retries the request itself; a stream that dies before its
first delta is retried here); after it, the partial reply is kept and the turn
ends with `finish_reason` error, marked `interrupted` (the session layer stores
it so, for the user to continue or regenerate). Cancelling closes the stream, and the server
aborts the request when its connection closes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

from kvchat.chat.engine_port import Turn, TurnFinished
from kvchat.engine.api import (
    CacheCounters,
    CachedTokens,
    EngineEvent,
    EngineStats,
    FinishReason,
    RequestStarted,
    Residency,
    TokenGenerated,
    TypeAheadProgress,
)
from kvchat.rate_window import RateWindow
from kvchat.remote.metrics import MetricsPoller, ServerMetrics
from kvchat.remote.server import CACHE_REPORT_FLAGS, RemoteServer, ServerInfo

log = logging.getLogger("kvchat.remote")

RETRIES_BEFORE_FIRST_TOKEN = 2
RATE_WINDOW_S = 3.0
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(frozen=True)
class RemoteStats(EngineStats):
    """`EngineStats` of a remote server: kvchat's own sums over its turns plus `/metrics`.

    The embedded-only figures (pages, evictions, recompute) are None in `to_json`,
    and `engine` says which server this is.
    """

    engine: dict[str, str] = field(default_factory=dict)  # kind, url, model
    server: ServerMetrics | None = None
    reports_cached: bool = False
    # what the meters say instead of a hit rate when the server reports no cached tokens
    not_reported: str = ""

    @property
    def hit_rate(self) -> float | None:  # type: ignore[override]
        if not self.reports_cached:
            return None
        return self.cache.hit_rate

    @property
    def pages_note(self) -> str:
        """The pages meter's line: the server's KV pool use, where it says it."""
        usage = self.server.kv_usage if self.server else None
        return "not reported by the server" if usage is None else f"server KV in use {usage:.0%}"

    @property
    def evictions_note(self) -> str:
        preempted = self.server.preemptions if self.server else None
        if preempted is None:
            return "not reported by the server"
        return f"{preempted:,.0f} preemptions on the server"

    def to_json(self) -> dict[str, object]:
        server = self.server
        c = self.cache
        return {
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": {
                "device": c.cached_tokens.device if self.reports_cached else None,
                "host": None,
                "disk": None,
            },
            "prefilled_tokens": c.prefilled_tokens if self.reports_cached else None,
            "recomputed_tokens": None,
            "generated_tokens": self.generated_tokens,
            "pages": None,
            "evictions": None,
            "requests": {
                "running": None if server is None else server.running,
                "waiting": None if server is None else server.waiting,
            },
            "preemptions": None if server is None else server.preemptions,
            "decode_tok_s": self.decode_tok_s,
            "prefill_tok_s": None,
            "page_size": None,
            "time": self.time,
            "hit_rate": self.hit_rate if c.prompt_tokens else None,
            "engine": dict(self.engine),
            "server": None if server is None else asdict(server),
        }


@dataclass
class _Live:
    turn: Turn
    on_event: Callable[[EngineEvent], None]
    cancelled: bool = False
    stream: Any = None


class RemoteEngine:
    """A `TurnPort` over one server; `connect` discovers it and starts the metrics poller."""

    streams_token_ids = False  # the server sends text; the ids it generated stay unknown

    def __init__(self, server: RemoteServer, info: ServerInfo) -> None:
        self.server = server
        self.info = info
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._prompt = self._cached = self._prefilled = self._generated = 0
        self._token_rate = RateWindow(RATE_WINDOW_S)  # token arrivals
        self.poller: MetricsPoller | None = None
        if info.has_metrics:
            self.poller = MetricsPoller(server.metrics_text, info.kind).start()

    @classmethod
    def connect(cls, server: RemoteServer, model: str | None = None) -> RemoteEngine:
        """Discover the server and probe whether it reports cached tokens; RemoteError if not."""
        info = server.discover(model)
        reports = server.probe_cached_tokens(info)
        info = ServerInfo(
            info.kind, info.model, info.models, info.context_length, info.has_metrics, reports
        )
        return cls(server, info)

    # ----------------------------------------------------------------- the port

    @property
    def model_fingerprint(self) -> str:
        return f"remote:{self.info.kind}:{self.info.model}"

    @property
    def context_length(self) -> int:
        # unknown: large, so the server's own 400 is what stops an overlong prompt
        return self.info.context_length or 1 << 20

    @property
    def reports_cached(self) -> bool:
        return bool(self.info.reports_cached)

    def submit_turn(self, turn: Turn, on_event: Callable[[EngineEvent], None]) -> int:
        request_id = next(self._ids)
        live = _Live(turn, on_event)
        with self._lock:
            self._live[request_id] = live
        thread = threading.Thread(
            target=self._run, args=(request_id, live), name=f"kvchat-remote-{request_id}"
        )
        thread.daemon = True
        thread.start()
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return
            live.cancelled = True
            stream = live.stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()  # the server sees the connection close and aborts the request

    def type_ahead(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """No type-ahead on a server (its renderer offers no type-ahead ids): an id that does
        nothing."""
        return next(self._ids)

    def prefetch(self, token_ids: Sequence[int]) -> None:
        """Nothing to do: the server decides what stays in its cache."""

    def residency(self, token_ids: Sequence[int]) -> Residency:
        """Unknown for a server (nothing is drawn): it does not say where a prefix lives."""
        return Residency(0, 0, 0)

    def stats(self) -> RemoteStats:
        now = time.monotonic()
        with self._lock:
            decode_rate = self._token_rate.rate(now) or 0.0
            running = len(self._live)
            totals = (self._prompt, self._cached, self._prefilled, self._generated)
        prompt, cached, prefilled, generated = totals
        return RemoteStats(
            cache=CacheCounters(
                prompt_tokens=prompt,
                cached_tokens=CachedTokens(cached, 0, 0),
                prefilled_tokens=prefilled,
            ),
            generated_tokens=generated,
            requests={"running": running},
            decode_tok_s=decode_rate,
            time=now,
            engine=self.describe_engine(),
            server=self.poller.latest if self.poller else None,
            reports_cached=self.reports_cached,
            not_reported=""
            if self.reports_cached
            else "not reported by the server (start it with "
            f"{CACHE_REPORT_FLAGS.get(self.info.kind, CACHE_REPORT_FLAGS['unknown'])})",
        )

    def connected_line(self) -> str:
        """What a command prints at start: the server, its model and what it reports."""
        info = self.info
        context = (
            f"context {info.context_length:,} tokens"
            if info.context_length
            else ("context length not reported")
        )
        cached = (
            "cached tokens reported"
            if self.reports_cached
            else "cached tokens not reported (start it with "
            f"{CACHE_REPORT_FLAGS.get(info.kind, CACHE_REPORT_FLAGS['unknown'])})"
        )
        where = f"{info.name} at {self.server.root}"
        return f"kvchat: {where}, model {info.model} ({context}; {cached})"

    def describe_engine(self) -> dict[str, str]:
        return {"kind": self.info.kind, "url": self.server.root, "model": self.info.model}

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for request_id in live:
            self.cancel(request_id)
        if self.poller is not None:
            self.poller.close()
        self.server.close()

    # --------------------------------------------------------------- streaming

    def _request_kwargs(self, turn: Turn) -> dict[str, Any]:
        s = turn.sampling
        extra: dict[str, Any] = {}
        if s.top_k:
            extra["top_k"] = s.top_k
        if s.min_p:
            extra["min_p"] = s.min_p
        if s.repetition_penalty != 1.0:
            extra["repetition_penalty"] = s.repetition_penalty
        if turn.ignore_eos:
            extra["ignore_eos"] = True
        kwargs: dict[str, Any] = {
            "model": self.info.model,
            "messages": [dict(m) for m in turn.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": turn.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "extra_headers": {self.server.options.session_header: turn.session_id},
        }
        if s.seed is not None:
            kwargs["seed"] = s.seed
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _run(self, request_id: int, live: _Live) -> None:
        start = time.monotonic()
        emit = live.on_event
        emit(RequestStarted(request_id, start))
        text: list[str] = []
        first: float | None = None
        usage: Any = None
        timings: dict[str, Any] | None = None
        reason: FinishReason | None = None
        error: str | None = None
        deltas = 0
        attempt = 0
        while True:
            try:
                kwargs = self._request_kwargs(live.turn)
                stream = self.server.client.chat.completions.create(**kwargs)
                with self._lock:
                    live.stream = stream
                    cancelled = live.cancelled
                if cancelled:
                    stream.close()
                for chunk in stream:
                    extra = chunk.model_extra or {}
                    if isinstance(extra.get("timings"), dict):
                        timings = extra["timings"]
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        piece = choice.delta.content if choice.delta else None
                        if piece:
                            now = time.monotonic()
                            if first is None:
                                first = now
                            text.append(piece)
                            deltas += 1
                            with self._lock:
                                self._token_rate.add(now, 1)
                            emit(TokenGenerated(request_id, piece, (), now))
                        if choice.finish_reason:
                            reason = _FINISH.get(choice.finish_reason, FinishReason.STOP)
                if live.cancelled:
                    reason = FinishReason.CANCELLED
                elif reason is None:
                    # the stream ended without a finish reason: the server went away mid-reply
                    raise ConnectionError("the stream ended before the reply was finished")
                break
            except Exception as exc:
                if live.cancelled:
                    reason = FinishReason.CANCELLED
                    break
                if first is None and attempt < RETRIES_BEFORE_FIRST_TOKEN and _retryable(exc):
                    attempt += 1
                    time.sleep(0.5 * 2**attempt)  # backoff: 1 s, then 2 s
                    continue
                reason = FinishReason.ERROR
                error = self._explain_mid_stream(exc, bool(text))
                if not isinstance(exc, openai.APIStatusError | ConnectionError):
                    log.warning("remote turn %d failed: %r", request_id, exc)
                break
        with self._lock:
            self._live.pop(request_id, None)
        emit(self._finished(request_id, reason, usage, timings, text, deltas, start, first, error))

    def _explain_mid_stream(self, exc: BaseException, partial: bool) -> str:
        line = self.server.explain(exc, model=self.info.model, context=self.info.context_length)
        if isinstance(exc, ConnectionError):
            line = f"the server at {self.server.root} closed the stream mid-reply"
        if partial:
            line += "; the partial reply is kept (continue or regenerate)"
        return line

    def _finished(
        self,
        request_id: int,
        reason: FinishReason,
        usage: Any,
        timings: dict[str, Any] | None,
        text: list[str],
        deltas: int,
        start: float,
        first: float | None,
        error: str | None,
    ) -> TurnFinished:
        end = time.monotonic()
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0) if usage is not None else 0
        generated = int(getattr(usage, "completion_tokens", 0) or 0) if usage else deltas
        cached = _cached_tokens(usage, timings, self.reports_cached)
        if timings and not prompt:
            prompt = int(timings.get("cache_n", 0) or 0) + int(timings.get("prompt_n", 0) or 0)
        decode = (generated - 1) / (end - first) if first is not None and generated > 1 else None
        with self._lock:
            self._prompt += prompt
            self._generated += generated
            if cached is not None:
                self._cached += cached
                self._prefilled += prompt - cached
        return TurnFinished(
            request_id=request_id,
            reason=reason,
            prompt_tokens=prompt,
            cached_tokens=CachedTokens(cached, None, None),
            prefilled_tokens=None if cached is None else prompt - cached,
            recomputed_tokens=None,
            generated_ids=(),
            text="".join(text),
            ttft_s=None if first is None else first - start,
            decode_tok_s=decode,
            time=end,
            error=error,
            generated_count=generated,
            interrupted=reason == FinishReason.ERROR and bool(text),
        )

    def cache_note(self) -> str:
        """The meters' lines about the server: what it is, its cache, its queue."""
        info = self.info
        lines = [f"{info.name} {self.server.root}", f"model {info.model}"]
        if not self.reports_cached:
            lines.append(
                "cached tokens: not reported by the server (start it with "
                f"{CACHE_REPORT_FLAGS.get(info.kind, CACHE_REPORT_FLAGS['unknown'])})"
            )
        m = self.poller.latest if self.poller else None
        if self.poller is None:
            lines.append("server metrics: none (/metrics not served)")
        elif self.poller.error and m is None:
            lines.append(f"server metrics: unreadable ({self.poller.error[:60]})")
        if m is not None:
            if m.kv_usage is not None:
                lines.append(f"server KV in use {m.kv_usage:.0%}")
            if m.hit_rate is not None:
                lines.append(f"server prefix hits {m.hit_rate:.0%}")
            if m.external_hit_rate is not None:
                lines.append(f"offload tier hits {m.external_hit_rate:.0%}")
            if m.host_total_tokens:
                lines.append(f"host tier {m.host_used_tokens or 0:,.0f}/{m.host_total_tokens:,.0f}")
            queue = []
            if m.running is not None:
                queue.append(f"running {m.running:.0f}")
            if m.waiting is not None:
                queue.append(f"waiting {m.waiting:.0f}")
            if m.preemptions is not None:
                queue.append(f"preempted {m.preemptions:.0f}")
            if queue:
                lines.append(" ".join(queue))
            if self.poller and self.poller.error:
                lines.append("server metrics: not answering")
        return "\n".join(lines)


def _cached_tokens(usage: Any, timings: dict[str, Any] | None, reports: bool) -> int | None:
    """The server's cached prompt tokens; 0 when it reports them but sent none, else None."""
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if isinstance(cached, int):
        return cached
    if timings and isinstance(timings.get("cache_n"), int):
        return int(timings["cache_n"])
    if usage is not None:
        extra = getattr(usage, "model_extra", None) or {}
        if isinstance(extra.get("cached_tokens"), int):  # some servers put it at the top level
            return int(extra["cached_tokens"])
    return 0 if reports and usage is not None else None


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return isinstance(exc, openai.APIConnectionError | ConnectionError | OSError) or (
        type(exc).__module__.startswith("httpx")
    )
