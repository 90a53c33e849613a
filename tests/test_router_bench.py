"""benchmarks/router_bench.py: its figures from a bench's JSON, and a real router's affinity.

The figures are checked on a bench.json shaped as `kvchat bench` writes it. The
router (vllm-router from PyPI, installed once into the servers cache) is run for real in
front of two llama-server replicas, each behind a recording proxy, to check what the
benchmark relies on: kvchat's session header keeps every turn of a session on one
replica, and its follow-ups are served from that replica's cache.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.chat.events import ReplyFinished
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.api import SamplingParams
from kvchat.remote import RemoteOptions, open_remote_backend
from tests.fault_proxy import FaultProxy
from tests.servers import start_llama_server

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "router_bench.py"
_spec = importlib.util.spec_from_file_location("router_bench", SCRIPT)
assert _spec is not None and _spec.loader is not None
router_bench = importlib.util.module_from_spec(_spec)
sys.modules["router_bench"] = router_bench  # its dataclasses look their module up
_spec.loader.exec_module(router_bench)

# ~300 tokens: the follow-up's prompt holds whole cache blocks of any server
DOCUMENT = " ".join(
    f"Fact {i}: the station at kilometre {i * 7} has {i % 5 + 2} platforms." for i in range(30)
)


def _turn(session: int, turn: int, prompt: int, prefilled: int, ttft: float) -> dict:
    return {
        "session": session,
        "turn": turn,
        "ttft_s": ttft,
        "prompt_tokens": prompt,
        "prefilled_tokens": prefilled,
    }


def _bench(engines: dict[str, list[dict]], **extra) -> dict:
    return {
        "workloads": {
            "W1": {
                "engines": {
                    name: {"runs": [{"turns": turns}], "median": {"total_s": 12.5}}
                    for name, turns in engines.items()
                },
                "errors": {},
            }
        },
        **extra,
    }


def test_follow_up_figures_count_only_follow_ups_of_the_engine_on_the_server() -> None:
    remote = [
        _turn(0, 1, 3000, 3000, 9.0),  # an opener: not a follow-up
        _turn(1, 1, 3000, 3000, 9.0),
        _turn(0, 2, 3100, 100, 0.2),  # served from the cache
        _turn(1, 2, 3100, 3100, 8.0),  # landed where nothing was cached
        _turn(0, 3, 3200, 100, 0.3),
    ]
    embedded = [_turn(0, 1, 3000, 3000, 1.0), _turn(0, 2, 3100, 50, 0.05)]
    data = _bench({"kvchat": embedded, "kvchat@llama-server": remote})
    f = router_bench.follow_up_figures(data)
    assert f["engine"] == "kvchat@llama-server" and f["follow_ups"] == 3
    assert f["prompt_tokens"] == 9400 and f["cached_tokens"] == 3000 + 0 + 3100
    assert f["hit_rate"] == pytest.approx(6100 / 9400)
    assert f["ttft_follow_up_s"] == 0.3 and f["total_s"] == 12.5
    own = router_bench.follow_up_figures(data, "kvchat")
    assert own["hit_rate"] == pytest.approx(3050 / 3100)


def test_a_bench_that_ran_nothing_on_the_server_says_why() -> None:
    data = _bench({"kvchat": []}, skipped={"kvchat@server": "cannot reach the server"})
    with pytest.raises(ValueError, match="cannot reach the server"):
        router_bench.follow_up_figures(data)


def test_the_verdict_checks_both_halves_of_the_bar() -> None:
    lines = router_bench.verdict(
        {
            "single": {"hit_rate": 0.95},
            "affinity": {"hit_rate": 0.90},
            "round-robin": {"hit_rate": 0.86},
            "random": {"hit_rate": 0.50},
        }
    )
    assert lines[0].startswith("affinity keeps 0.95 of one server's") and lines[0].endswith(": met")
    assert "+0.04 over round-robin's" in lines[1] and lines[1].endswith("NOT met")
    assert "+0.40 over random's" in lines[2] and lines[2].endswith(": met")
    low = router_bench.verdict({"single": {"hit_rate": 0.95}, "affinity": {"hit_rate": 0.5}})
    assert low == [
        "affinity keeps 0.53 of one server's follow-up hit rate (bar: at least 0.9): NOT met"
    ]


def test_everything_it_starts_listens_on_localhost() -> None:
    replica = router_bench.replica_argv(Path("llama-server"), Path("m.gguf"), 8001, 1)
    router = router_bench.router_argv(Path("vllm-router"), "consistent_hash", 8000, ["u"], 9)
    for argv in (replica, router):
        hosts = [argv[i + 1] for i, a in enumerate(argv) if a.endswith("-host")]
        assert hosts and set(hosts) == {"127.0.0.1"}, argv
    assert replica[replica.index("-t") + 1] == "1" and "--metrics" in replica


@pytest.fixture(scope="module")
def router_binary() -> Path:
    try:
        return router_bench.router_binary(router_bench.router_venv())
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"{router_bench.ROUTER_PACKAGE} cannot be installed here: {exc}")


@pytest.mark.slow
def test_the_router_keeps_each_session_on_one_replica_by_its_header(
    default_gguf_path, router_binary, tmp_path
) -> None:
    replicas = [start_llama_server(default_gguf_path, slots=2, ctx=4096) for _ in range(2)]
    proxies = [FaultProxy(r.port) for r in replicas]  # record what reaches each replica
    processes = router_bench.Processes()
    try:
        port = router_bench.free_port()
        workers = [f"http://127.0.0.1:{p.port}" for p in proxies]
        argv = router_bench.router_argv(
            router_binary, "consistent_hash", port, workers, router_bench.free_port()
        )
        log = tmp_path / "router.log"
        root = f"http://127.0.0.1:{port}"
        router_bench.wait_ready(root, processes.start(argv, log), log, "the router")
        backend = open_remote_backend(RemoteOptions(url=root + "/v1"))
        service = SessionService(
            backend.engine,
            backend.renderer,
            Store.in_memory(),
            default_sampling=SamplingParams(temperature=0.0),
            default_max_tokens=8,
        )
        finished: list[ReplyFinished] = []
        service.subscribe(lambda e: finished.append(e) if isinstance(e, ReplyFinished) else None)
        try:
            # three sessions taking turns: round robin over two replicas would split each one
            sessions = [service.create_session(f"s{i}") for i in range(3)]
            for text in (DOCUMENT, "How many platforms at kilometre 21?"):
                for sid in sessions:
                    service.say(sid, text)
                    assert service.wait_idle(sid, timeout=300)
        finally:
            service.close()
        assert all(e.stats.finish_reason in ("stop", "length") for e in finished), finished
        where: dict[str, set[int]] = {}
        for i, proxy in enumerate(proxies):
            for headers in proxy.chat_headers:
                where.setdefault(headers.get("x-session-id", ""), set()).add(i)
        assert set(where) == set(sessions)
        assert all(len(replica) == 1 for replica in where.values()), where
        for e in finished[3:]:  # the follow-ups: the replica had the session's prefix
            cached = e.stats.cached_tokens.device or 0
            assert cached > e.stats.prompt_tokens / 2, e.stats
    finally:
        processes.stop_all()
        for proxy in proxies:
            proxy.close()
        for replica in replicas:
            replica.stop()
