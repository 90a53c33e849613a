"""The `/metrics` mapping of each serving engine onto kvchat's meters.

SGLang does not install on CPU machines, so its text here is shaped exactly as
its collector (prometheus_client gauges/counters labelled by model and ranks)
emits it; vLLM's and llama-server's mappings are also checked against the real
servers in test_remote_servers.py.
"""

from __future__ import annotations

import pytest

from kvchat.remote.metrics import MetricsPoller, detect_kind, parse_metrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 2.0
vllm:num_requests_running{engine="1",model_name="smollm2"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="smollm2"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="smollm2"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 768.0
vllm:prefix_cache_hits_total{engine="1",model_name="smollm2"} 512.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="smollm2"} 400.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="smollm2"} 100.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 4.0
"""

# As sglang/srt/metrics/collector.py registers them (labels: model_name, tp_rank, ...)
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 0.6
# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0",pid="7"} 0.0
# HELP sglang:hicache_host_used_tokens Number of tokens currently used in the host KV cache.
# TYPE sglang:hicache_host_used_tokens gauge
sglang:hicache_host_used_tokens{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 2048.0
# HELP sglang:hicache_host_total_tokens Total capacity of the host KV cache in tokens.
# TYPE sglang:hicache_host_total_tokens gauge
sglang:hicache_host_total_tokens{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 65536.0
"""

SGLANG_RETRACTED = (
    SGLANG_TEXT
    + """\
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="qwen",tp_rank="0",pp_rank="0",moe_ep_rank="0"} 6.0
"""
)

LLAMA_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 900
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 600
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_kind_is_detected_from_the_metric_prefixes() -> None:
    assert detect_kind(VLLM_TEXT) == "vllm"
    assert detect_kind(SGLANG_TEXT) == "sglang"
    assert detect_kind(LLAMA_TEXT) == "llama-server"
    assert detect_kind(
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1\n"
    ) == ("unknown")


def test_vllm_counters_and_gauges_are_summed_over_the_engine_label() -> None:
    m = parse_metrics(VLLM_TEXT)
    assert m.kind == "vllm"
    assert m.running == 3 and m.waiting == 3
    assert m.kv_usage == pytest.approx(0.5)  # the mean over engines
    assert (m.prefix_queries, m.prefix_hits) == (2000, 1280)
    assert m.hit_rate == pytest.approx(0.64)
    assert m.external_hit_rate == pytest.approx(0.25)
    assert m.preemptions == 4


def test_sglang_maps_usage_hit_rate_queue_host_tier_and_retractions() -> None:
    m = parse_metrics(SGLANG_TEXT)
    assert m.kind == "sglang"
    assert m.kv_usage == pytest.approx(0.28)
    assert m.hit_rate == pytest.approx(0.6)  # no counters: the server's own rate
    assert (m.running, m.waiting) == (5, 1)
    assert (m.host_used_tokens, m.host_total_tokens) == (2048, 65536)
    assert m.preemptions == 0  # the gauge exists, the counter not yet: none so far
    assert parse_metrics(SGLANG_RETRACTED).preemptions == 6


def test_llama_server_maps_prompt_counters_and_reports_no_kv_usage() -> None:
    m = parse_metrics(LLAMA_TEXT)
    assert m.kind == "llama-server"
    assert m.hit_rate == pytest.approx(600 / 1500)  # its prompt counter excludes cached tokens
    assert (m.running, m.waiting) == (1, 0)
    assert m.kv_usage is None and m.preemptions is None  # not exposed: never a made-up 0


def test_poller_keeps_the_last_reading_and_records_a_failure() -> None:
    texts = [VLLM_TEXT]

    def fetch() -> str:
        if not texts:
            raise ConnectionError("connection refused")
        return texts.pop()

    poller = MetricsPoller(fetch, "vllm", interval_s=3600)
    assert poller.poll_once() is not None and poller.error is None
    first = poller.latest
    assert poller.poll_once() is first
    assert poller.error == "connection refused"
