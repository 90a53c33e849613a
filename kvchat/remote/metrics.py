"""A server's Prometheus `/metrics` text mapped onto kvchat's meters, and the poller reading it.

Each serving engine names its cache figures its own way; `ServerMetrics` is the
one shape the meters read. Counters are summed over labels (vLLM labels every
series with its `engine` index, SGLang with ranks), gauges too (a KV usage is
the mean over the engines that report one). A figure the server does not expose
stays None, so a meter says "not reported" instead of showing a made-up zero.
The text is parsed with `prometheus_client`'s parser, never by hand.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

KINDS = {"vllm:": "vllm", "sglang:": "sglang", "llamacpp:": "llama-server"}


@dataclass(frozen=True)
class ServerMetrics:
    """One reading of a server's `/metrics`; None where the server exposes nothing for it."""

    kind: str  # "vllm" | "sglang" | "llama-server" | "unknown"
    kv_usage: float | None = None  # fraction of the KV pool in use (0..1)
    prefix_queries: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_hits: float | None = None  # of which served from it
    server_hit_rate: float | None = None  # a hit rate the server computes itself (SGLang)
    external_queries: float | None = None  # vLLM's offload tier (CPU / LMCache)
    external_hits: float | None = None
    host_used_tokens: float | None = None  # SGLang HiCache's host tier
    host_total_tokens: float | None = None
    preemptions: float | None = None  # vLLM preemptions, SGLang retractions
    running: float | None = None
    waiting: float | None = None
    time: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        """Cumulative prefix hits / queries, or the server's own rate when it has no counters."""
        if self.prefix_queries:
            return (self.prefix_hits or 0.0) / self.prefix_queries
        return self.server_hit_rate

    @property
    def external_hit_rate(self) -> float | None:
        if self.external_queries:
            return (self.external_hits or 0.0) / self.external_queries
        return None


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def detect_kind(text: str) -> str:
    """The engine whose metric prefix the text carries ("unknown" when none)."""
    for prefix, kind in KINDS.items():
        if f"\n{prefix}" in f"\n{text}" or f"# TYPE {prefix}" in text:
            return kind
    return "unknown"


def parse_metrics(text: str, kind: str | None = None, now: float | None = None) -> ServerMetrics:
    """Map one `/metrics` text onto `ServerMetrics` (`kind` detected when not given)."""
    samples = _samples(text)
    kind = kind or detect_kind(text)

    def total(*names: str) -> float | None:
        for name in names:
            if name in samples:
                return sum(v for _, v in samples[name])
        return None

    def mean(*names: str) -> float | None:
        for name in names:
            if samples.get(name):
                values = [v for _, v in samples[name]]
                return sum(values) / len(values)
        return None

    stamp = time.monotonic() if now is None else now
    if kind == "vllm":
        return ServerMetrics(
            kind=kind,
            # gpu_cache_usage_perc is the name before vLLM 0.10
            kv_usage=mean("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_queries=total("vllm:prefix_cache_queries_total"),
            prefix_hits=total("vllm:prefix_cache_hits_total"),
            external_queries=total("vllm:external_prefix_cache_queries_total"),
            external_hits=total("vllm:external_prefix_cache_hits_total"),
            preemptions=total("vllm:num_preemptions_total"),
            running=total("vllm:num_requests_running"),
            waiting=total("vllm:num_requests_waiting"),
            time=stamp,
        )
    if kind == "sglang":
        return ServerMetrics(
            kind=kind,
            kv_usage=mean("sglang:token_usage"),
            server_hit_rate=mean("sglang:cache_hit_rate"),
            host_used_tokens=total("sglang:hicache_host_used_tokens"),
            host_total_tokens=total("sglang:hicache_host_total_tokens"),
            # the counter appears at the first retraction; before it there were none
            preemptions=total("sglang:num_retracted_requests_total")
            if "sglang:num_retracted_requests_total" in samples
            else (0.0 if "sglang:num_retracted_reqs" in samples else None),
            running=total("sglang:num_running_reqs"),
            waiting=total("sglang:num_queue_reqs"),
            time=stamp,
        )
    if kind == "llama-server":
        computed = total("llamacpp:prompt_tokens_total")  # excludes the cached ones
        cached = total("llamacpp:prompt_tokens_cached_total")
        return ServerMetrics(
            kind=kind,
            prefix_queries=None if computed is None else computed + (cached or 0.0),
            prefix_hits=cached,
            running=total("llamacpp:requests_processing"),
            waiting=total("llamacpp:requests_deferred"),
            time=stamp,
        )
    return ServerMetrics(kind="unknown", time=stamp)


class MetricsPoller:
    """Reads `/metrics` once a second on a daemon thread; `latest` is the last good reading.

    `fetch` returns the text or raises; a failed reading keeps the previous one and
    records the error, so a meter can say the server stopped answering.
    """

    def __init__(self, fetch: Callable[[], str], kind: str, interval_s: float = 1.0) -> None:
        self._fetch = fetch
        self._kind = kind
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.latest: ServerMetrics | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvchat-metrics", daemon=True)

    def start(self) -> MetricsPoller:
        self.poll_once()
        self._thread.start()
        return self

    def poll_once(self) -> ServerMetrics | None:
        try:
            self.latest = parse_metrics(self._fetch(), self._kind)
            self.error = None
        except Exception as exc:  # the server is down or has no /metrics: keep the last reading
            self.error = str(exc) or type(exc).__name__
        return self.latest

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll_once()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._thread.join(2.0)
